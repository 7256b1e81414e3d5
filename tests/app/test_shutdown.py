"""Shutdown with work queued: queued requests are refused at once, nothing new starts
upstream once the drain began, and every stream cut by the drain deadline gets its real row."""

import asyncio
import sqlite3

from tests.support import httpc
from tests.support.helpers import wait_for

CHAT = "/v1/chat/completions"


def rows(db: str) -> list[dict]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM request ORDER BY ts")]
    finally:
        conn.close()


async def _send(port: int, body: dict, rid: str):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(httpc.build_request("POST", CHAT, body, {"X-Request-Id": rid}))
    return reader, writer


async def _read_all(reader, writer) -> httpc.Response | None:
    """The whole answer, or None for an empty reply (closed without a status line)."""
    try:
        resp = await asyncio.wait_for(httpc.read_head(reader), 10)
    except asyncio.IncompleteReadError:
        writer.close()
        return None
    await asyncio.wait_for(httpc.read_body(reader, resp), 10)
    writer.close()
    return resp


async def test_shutdown_refuses_the_queue_and_settles_cut_streams(make_relay, sim, tmp_path):
    db = str(tmp_path / "relay.db")
    app = await make_relay(store=db, parallel=5, queue=64)
    up = app.upstreams["llm"]
    streams = [await _send(app.port, httpc.chat(400, interval_ms=10), f"s{i}") for i in range(5)]
    heads = [await asyncio.wait_for(httpc.read_head(r), 10) for r, _ in streams]
    assert [h.status for h in heads] == [200] * 5
    reading = [asyncio.create_task(httpc.read_body(r, h)) for (r, _), h in zip(streams, heads)]
    queued = [await _send(app.port, httpc.chat(5), f"q{i}") for i in range(15)]
    await wait_for(lambda: up.slots.queued == 15)
    await wait_for(lambda: all(r.tokens_sent >= 3 for r in sim.requests))

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stopping = asyncio.create_task(app.stop(drain_timeout_s=1.0))
    answers = await asyncio.gather(*(_read_all(r, w) for r, w in queued))
    refused_after = loop.time() - t0
    await asyncio.wait_for(asyncio.gather(*reading), 10)
    for _, w in streams:
        w.close()
    await asyncio.wait_for(stopping, 10)

    # the queue is answered at once (well before the drain deadline), 503 shutting_down
    assert all(a is not None for a in answers), "an empty reply"
    assert [a.status for a in answers] == [503] * 15
    assert [(a.status, a.json()["error"]["code"]) for a in answers] == [(503, "shutting_down")] * 15
    assert refused_after < 0.5
    # no upstream stream started after the drain began: only the five streams
    assert len(sim.requests) == 5
    # the cut streams: a visible truncation, and rows with what really went out
    assert all(h.status == 200 and not h.complete for h in heads)
    by_id = {r["request_id"]: r for r in rows(db)}
    assert len(by_id) == 20
    for i, h in enumerate(heads):
        row = by_id[f"s{i}"]
        tokens = sum(
            1 for e in h.data_events() if e != "[DONE]" and e["choices"][0]["delta"].get("content")
        )
        assert (row["status"], row["upstream_served"], row["ok"], row["error_code"]) == (
            200,
            "llm",
            0,
            "shutdown",
        )
        assert row["bytes_out"] == len(h.raw_body)
        assert row["completion_tokens"] == tokens and tokens >= 3
    for i in range(15):
        row = by_id[f"q{i}"]
        assert (row["status"], row["error_code"], row["upstream_served"], row["bytes_out"]) == (
            503,
            "shutting_down",
            None,
            len(answers[i].raw_body),
        )


async def test_sigterm_with_a_queue_on_a_relay_process(tmp_path):
    """The issue's run: 5 streams, 15 queued, drain 2 s, SIGTERM to a real relay process."""
    import signal

    from relay.sim.server import Simulator
    from tests.support.processes import start, wait_listening

    sim = Simulator()
    await sim.start()
    db = tmp_path / "relay.db"
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'[server]\nport = 0\ndrain_timeout_s = 2\n[store]\npath = "{db}"\n'
        f'[[upstream]]\nname = "llm"\nurl = "{sim.url}"\nparallel = 5\n'
    )
    proc = await start("serve", "--config", str(cfg))
    try:
        port, _ = await wait_listening(proc)
        streams = [await _send(port, httpc.chat(1000, interval_ms=20), f"s{i}") for i in range(5)]
        heads = [await asyncio.wait_for(httpc.read_head(r), 10) for r, _ in streams]
        reading = [asyncio.create_task(httpc.read_body(r, h)) for (r, _), h in zip(streams, heads)]
        queued = [await _send(port, httpc.chat(5), f"q{i}") for i in range(15)]
        chats = lambda: [r for r in sim.requests if r.path == CHAT]  # noqa: E731 (no probes)
        await wait_for(lambda: len(chats()) == 5 and all(r.tokens_sent >= 2 for r in chats()))
        queued_now = 0

        async def poll_queue():
            nonlocal queued_now
            while queued_now < 15:
                m = await httpc.fetch(port, "GET", "/api/slots/metrics")
                queued_now = m.json()["llm"]["queued"]
                await asyncio.sleep(0.02)

        await asyncio.wait_for(poll_queue(), 10)  # all 15 wait for a slot in the relay
        proc.send_signal(signal.SIGTERM)
        answers = await asyncio.gather(*(_read_all(r, w) for r, w in queued))
        await asyncio.wait_for(asyncio.gather(*reading), 10)
        for _, w in streams:
            w.close()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await sim.stop()
    assert [a.status if a else None for a in answers] == [503] * 15
    assert len(chats()) == 5
    assert all(h.status == 200 and not h.complete for h in heads)
    by_id = {r["request_id"]: r for r in rows(str(db))}
    assert len(by_id) == 20
    for i, h in enumerate(heads):
        row = by_id[f"s{i}"]
        assert (row["status"], row["upstream_served"]) == (200, "llm")
        assert row["bytes_out"] == len(h.raw_body) and row["completion_tokens"] > 0


async def test_a_request_half_read_when_the_drain_begins_gets_503(make_relay, sim, tmp_path):
    db = str(tmp_path / "relay.db")
    app = await make_relay(store=db)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    body = b'{"model": "tiny", "messages": []}'
    writer.write(httpc.build_request("POST", CHAT, body, {"X-Request-Id": "half"})[:-10])
    await wait_for(lambda: any(c.head is not None for c in app.clients))
    await app.stop(drain_timeout_s=1.0)
    resp = await _read_all(reader, writer)
    assert resp is not None, "an empty reply"
    assert (resp.status, resp.json()["error"]["code"]) == (503, "shutting_down")
    [row] = rows(db)
    assert (row["request_id"], row["status"], row["error_code"]) == ("half", 503, "shutting_down")
    assert not sim.requests


async def test_a_request_dispatched_in_the_drains_loop_pass_gets_an_answer_and_a_row(
    make_relay, sim, tmp_path, monkeypatch
):
    """SIGTERM handled in the same loop pass as a request's last bytes (the drain's first step
    runs before the request task's): the request is counted, answered 503, and has its row."""
    from relay.proxy import client as C

    db = str(tmp_path / "relay.db")
    app = await make_relay(store=db)
    orig, stopping = C.ClientConn._dispatch, []

    def dispatch_with_sigterm(self, conn):
        if not stopping:
            stopping.append(asyncio.get_running_loop().create_task(app.stop(drain_timeout_s=2.0)))
        orig(self, conn)

    monkeypatch.setattr(C.ClientConn, "_dispatch", dispatch_with_sigterm)
    reader, writer = await _send(app.port, httpc.chat(2), "racing")
    resp = await _read_all(reader, writer)
    await asyncio.wait_for(stopping[0], 10)
    assert resp is not None, "an empty reply"
    assert (resp.status, resp.json()["error"]["code"]) == (503, "shutting_down")
    assert (app.store.rows_written, app.store.rows_dropped) == (1, 0)
    [row] = rows(db)
    assert (row["request_id"], row["status"], row["error_code"]) == ("racing", 503, "shutting_down")
    assert not sim.requests


async def test_a_client_still_sending_its_body_when_the_drain_begins_reads_the_whole_503(
    make_relay, sim, tmp_path
):
    """The drain's 503 to a request half-read goes out with a lingering close: the client
    keeps sending and still reads the whole answer (not a reset), then the end of the stream."""
    db = str(tmp_path / "relay.db")
    app = await make_relay(store=db)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    size = 4 * 1024 * 1024
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: sending\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size + b" " * 20000
    )
    await wait_for(lambda: any(c.head is not None and c.body_size for c in app.clients))
    answered = asyncio.Event()

    async def keep_sending() -> int:
        sent = 0
        try:
            while not answered.is_set() and sent < size - 20000 - 65536:
                writer.write(b" " * 65536)
                await writer.drain()
                sent += 65536
        except ConnectionError:
            pass
        return sent

    stopping = asyncio.create_task(app.stop(drain_timeout_s=1.0))
    sender = asyncio.create_task(keep_sending())
    try:
        resp = await asyncio.wait_for(httpc.read_head(reader), 10)
        await asyncio.wait_for(httpc.read_body(reader, resp), 10)
        rest = await asyncio.wait_for(reader.read(), 10)  # the relay's end: EOF, not a reset
    finally:
        answered.set()
    assert (resp.status, resp.json()["error"]["code"]) == (503, "shutting_down")
    assert rest == b""
    assert await asyncio.wait_for(sender, 10) > 0  # it was still sending after the drain began
    await asyncio.wait_for(stopping, 10)
    writer.close()
    [row] = rows(db)
    assert (row["request_id"], row["status"], row["error_code"]) == (
        "sending",
        503,
        "shutting_down",
    )
    assert not sim.requests
