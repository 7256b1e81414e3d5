"""The pure parts of a config reload: budgets keep what was used, slots take new bounds."""

import asyncio
import concurrent.futures
import time

import pytest

from relay.config import ConfigError, KeyConfig, StoreConfig
from relay.policy.budget import BudgetExceeded, Budgets
from relay.proxy.slots import SlotPool

SHA = "a" * 64
NOW = 1_700_000_000.0


def test_budget_reload_keeps_used_and_reserved_and_reports_new_windows():
    b = Budgets([KeyConfig(id="k", sha256=SHA, requests_per_day=10)])
    done = b.reserve("k", 5, NOW)
    b.spend(done, 1, 7, NOW)
    flying = b.reserve("k", 3, NOW)
    fresh = b.reload(
        [
            KeyConfig(id="k", sha256=SHA, requests_per_day=2, tokens_per_month=100),
            KeyConfig(id="new", sha256=SHA, requests_per_day=1),
        ]
    )
    assert fresh == [("k", "monthly"), ("new", "daily")]
    assert b.usage("k", NOW)["daily"] == {
        "requests": 1,
        "tokens": 7,
        "reserved_requests": 1,
        "reserved_tokens": 3,
    }
    with pytest.raises(BudgetExceeded):  # 1 used + 1 reserved: the new limit of 2 is reached
        b.reserve("k", 1, NOW)
    b.spend(flying, 1, 2, NOW)  # settles in the window it reserved in
    assert b.usage("k", NOW)["daily"]["requests"] == 2
    b.reload([])  # a removed key: a reservation taken before still settles
    assert b.keys == {}


def test_budget_settle_after_the_key_was_removed():
    b = Budgets([KeyConfig(id="k", sha256=SHA, requests_per_day=10)])
    res = b.reserve("k", 5, NOW)
    b.reload([])
    b.spend(res, 1, 5, NOW)  # no KeyError
    assert res.empty


async def test_slot_resize_grants_waiters_and_shrinks_on_release():
    pool = SlotPool(1, 8)
    held = await pool.acquire(1.0)
    waiter = asyncio.ensure_future(pool.acquire(5.0))
    await asyncio.sleep(0)
    assert pool.queued == 1
    pool.resize(2, 8)
    second = await asyncio.wait_for(waiter, 1)
    assert pool.in_flight == 2
    pool.resize(1, 8)
    held.release()
    assert pool.in_flight == 1
    second.release()
    assert pool.in_flight == 0


async def test_reload_refuses_a_new_listen_address_or_store(make_relay):
    import msgspec

    app = await make_relay()
    for change in (
        {"server": msgspec.structs.replace(app.config.server, port=1)},
        {"store": StoreConfig(path="/tmp/other.db")},
        {"store": msgspec.structs.replace(app.config.store, url="postgresql://u@h/db")},
    ):
        new = msgspec.structs.replace(app.config, **change)
        with pytest.raises(ConfigError, match="needs a restart"):
            app.reload(new)
    assert app.config.server.port == 0


async def test_a_refused_reload_names_the_changed_keys_not_two_whole_tables(make_relay):
    """(issue 34 item 6) An `[otel]` change printed both structs whole; it names the keys."""
    import msgspec

    from relay.config import OtelConfig

    # (disabled: nothing of OpenTelemetry starts)
    app = await make_relay(otel=OtelConfig(disabled=True, endpoint="http://collector-a:4318"))
    for otel, message in (
        (
            OtelConfig(disabled=True, endpoint="http://collector-b:4318"),
            "otel.endpoint: changing it needs a restart",
        ),
        (
            OtelConfig(disabled=True, endpoint="http://b:4318", service_name="edge"),
            "otel.endpoint, otel.service_name: changing them needs a restart",
        ),
        (None, "otel: removed, which needs a restart"),
    ):
        with pytest.raises(ConfigError) as exc:
            app.reload(msgspec.structs.replace(app.config, otel=otel))
        assert str(exc.value) == message
    server = msgspec.structs.replace(app.config.server, workers=2)
    with pytest.raises(ConfigError) as exc:
        app.reload(msgspec.structs.replace(app.config, server=server))
    assert str(exc.value) == "server.workers: changing it needs a restart (1 -> 2)"


async def test_reload_timeouts_apply_to_new_streams_not_to_those_in_flight(make_relay, sim):
    import msgspec

    from tests.support import httpc
    from tests.support.helpers import wait_for

    app = await make_relay(stream_idle_timeout_s=5.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
    writer.write(
        httpc.build_request("POST", "/v1/chat/completions", httpc.chat(4, interval_ms=300))
    )
    head = await asyncio.wait_for(httpc.read_head(reader), 5)
    d = msgspec.structs.replace(app.config.dispatcher, stream_idle_timeout_s=0.1)
    app.reload(msgspec.structs.replace(app.config, dispatcher=d))
    late = await httpc.fetch(
        app.port, "POST", "/v1/chat/completions", httpc.chat(4, interval_ms=300)
    )
    await asyncio.wait_for(httpc.read_body(reader, head), 5)
    writer.close()
    assert head.complete and head.data_events()[-1] == "[DONE]"  # on the policy it started with
    assert late.data_events()[-2]["x_relay_stall"]["reason"] == "idle"  # the new bound
    await wait_for(lambda: len(app.log.of("access")) == 2)
    outcomes = sorted(r.get("error_code") or "ok" for r in app.log.of("access"))
    assert outcomes == ["ok", "stream_stall_idle"]


async def test_reload_applies_the_buffered_body_bound(make_relay, sim):
    """`max_buffered_body_bytes` changed by a reload bounds new bodies (it was built once)."""
    import msgspec

    from tests.support import httpc

    app = await make_relay(max_body_bytes=8192, max_buffered_body_bytes=2048)
    body = httpc.chat(2)
    body["messages"] = [{"role": "user", "content": "x" * 4000}]
    refused = await httpc.fetch(app.port, "POST", "/v1/chat/completions", body)
    assert (refused.status, refused.json()["error"]["code"]) == (503, "server_busy")
    server = msgspec.structs.replace(app.config.server, max_buffered_body_bytes=65536)
    app.reload(msgspec.structs.replace(app.config, server=server))
    assert app.bodies.limit == 65536
    served = await httpc.fetch(app.port, "POST", "/v1/chat/completions", body)
    assert served.status == 200 and served.complete
    assert app.bodies.held == 0


def test_a_window_a_reload_creates_is_charged_by_requests_in_flight_then():
    """Its used figures are rebuilt from the rows committed at the reload; requests admitted
    before it (a key with no limits, or a limit of another window) are charged when they
    settle, once; those admitted after it only through their own reservation."""
    b = Budgets(
        [KeyConfig(id="free", sha256=SHA), KeyConfig(id="k", sha256=SHA, requests_per_day=10)]
    )
    unlimited = b.reserve("free", 0, NOW)
    daily_only = b.reserve("k", 5, NOW)
    assert b.fresh_windows(
        [
            KeyConfig(id="free", sha256=SHA, tokens_per_day=1000),
            KeyConfig(id="k", sha256=SHA, requests_per_day=10, tokens_per_month=1000),
        ]
    ) == [("free", "daily"), ("k", "monthly")]
    fresh = b.reload(
        [
            KeyConfig(id="free", sha256=SHA, tokens_per_day=1000),
            KeyConfig(id="k", sha256=SHA, requests_per_day=10, tokens_per_month=1000),
        ]
    )
    assert fresh == [("free", "daily"), ("k", "monthly")]
    b.restore("free", "daily", 2, 50, NOW)  # what the rows held at the reload
    b.spend(unlimited, 1, 402, NOW)
    b.spend(unlimited, 1, 402, NOW)  # once
    assert b.usage("free", NOW)["daily"] == {
        "requests": 3,
        "tokens": 452,
        "reserved_requests": 0,
        "reserved_tokens": 0,
    }
    b.spend(daily_only, 1, 40, NOW)
    assert b.usage("k", NOW)["daily"]["tokens"] == 40
    assert b.usage("k", NOW)["monthly"]["tokens"] == 40
    after = b.reserve("free", 10, NOW)  # admitted under the new limit: its reservation only
    b.spend(after, 1, 8, NOW)
    assert b.usage("free", NOW)["daily"]["tokens"] == 460


async def test_a_reload_adding_a_token_limit_charges_a_stream_in_flight(make_relay, sim):
    """Over real sockets: a key without limits streams 400 tokens; a reload gives it 300 a
    day mid-stream; the stream is charged when it ends, and the next request is refused."""
    import msgspec

    from tests.support import httpc
    from tests.support.helpers import wait_for
    from tests.support.keys import bearer, key

    app = await make_relay(keys=[key()])
    body = httpc.chat(400, interval_ms=2)
    stream = asyncio.create_task(
        httpc.fetch(
            app.port, "POST", "/v1/chat/completions", body, {**bearer(), "X-Request-Id": "flying"}
        )
    )
    await wait_for(lambda: sim.requests and sim.requests[0].tokens_sent >= 1)
    app.reload(msgspec.structs.replace(app.config, key=[key(tokens_per_day=300)]))
    resp = await asyncio.wait_for(stream, 20)
    assert resp.status == 200 and resp.complete
    await wait_for(lambda: len(app.log.of("access")) == 1)
    used = app.budgets.usage("alpha", time.time())["daily"]
    assert (used["requests"], used["reserved_requests"], used["reserved_tokens"]) == (1, 0, 0)
    app.store.flush()
    [row] = app.store.query("SELECT prompt_tokens, completion_tokens FROM request")
    assert row["completion_tokens"] == 400
    assert used["tokens"] == row["prompt_tokens"] + 400
    refused = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(2), bearer())
    assert (refused.status, refused.json()["error"]["code"]) == (429, "budget_exceeded")


async def test_a_reload_whose_new_limits_cannot_be_rebuilt_changes_nothing(make_relay, monkeypatch):
    import msgspec

    from tests.support.keys import key

    app = await make_relay(keys=[key()])
    old = app.config

    def failing(windows):
        fut = concurrent.futures.Future()
        fut.set_exception(RuntimeError("store closed"))
        return fut

    monkeypatch.setattr(app.store, "usage_read", failing)
    new = msgspec.structs.replace(app.config, key=[key(tokens_per_day=300)])
    with pytest.raises(ConfigError, match=r"\(store closed\); nothing changed"):
        app.reload(new)
    with pytest.raises(ConfigError, match=r"\(store closed\); nothing changed"):
        await app.reload_async(new)
    assert app.config is old and app.budgets.windows_of("alpha") == []
    assert app.budgets._late is None  # (unstaged: settlements are not kept)


def test_requests_settled_while_a_reload_reads_the_rows_are_charged_to_its_windows():
    """The rows are read at `stage` (store: at that point of the row queue); a request that
    settles before the new windows exist is charged to them when they do, once, in the
    window of its admission; after a refusal (`unstage`) nothing is kept."""
    b = Budgets([KeyConfig(id="k", sha256=SHA)])
    early = b.reserve("k", 0, NOW)
    late = b.reserve("k", 0, NOW)
    b.stage()
    b.spend(early, 1, 30, NOW)  # settled while the rows are read: its row is not among them
    new = [KeyConfig(id="k", sha256=SHA, requests_per_day=10)]
    assert b.reload(new, {("k", "daily"): (4, 100)}, NOW) == [("k", "daily")]
    assert b.usage("k", NOW)["daily"]["requests"] == 5
    assert b.usage("k", NOW)["daily"]["tokens"] == 130
    b.spend(late, 1, 7, NOW)  # in flight at the reload: charged as it settles
    assert b.usage("k", NOW)["daily"]["tokens"] == 137
    b.stage()
    b.spend(b.reserve("k", 5, NOW), 1, 5, NOW)
    b.unstage()  # refused: the next reload rebuilds from rows that hold that one
    more = [KeyConfig(id="k", sha256=SHA, requests_per_day=10, tokens_per_month=900)]
    assert b.reload(more, {("k", "monthly"): (7, 142)}, NOW) == [("k", "monthly")]
    assert b.usage("k", NOW)["monthly"]["tokens"] == 142
    assert b.usage("k", NOW)["daily"]["tokens"] == 142  # (kept: its own figures)


async def test_an_injected_header_line_from_the_config_stops_the_start_and_a_reload(tmp_path):
    """(issue 21 item 4) A CR/LF in the auth value from the environment, or in auth_header,
    is refused at start (exit 2) and at SIGHUP (the running configuration stays), naming the
    key, never quoting the value; no injected line ever reaches the upstream."""
    import json
    import signal

    from tests.support import httpc
    from tests.support.fakeup import Scripted
    from tests.support.processes import kill, start, wait_listening

    async def serve(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            writer.write(b"Content-Length: 2\r\n\r\n{}")
            await writer.drain()

    up = await Scripted(serve).start()
    cfg = tmp_path / "relay.toml"

    def write(header: str, env: str) -> None:
        cfg.write_text(
            f"[server]\nport = 0\n[dispatcher]\nhealth_interval_s = 0\n[store]\npath = "
            f'"{tmp_path / "relay.db"}"\n[[upstream]]\nname = "llm"\nurl = "{up.url}"\n'
            f"auth_header = {json.dumps(header)}\nauth_value_env = {json.dumps(env)}\n"
        )

    env = {"GOOD_KEY": "sk-good-123", "BAD_KEY": "sk-bad-456\r\nX-Evil: 1"}
    write("X-Key", "BAD_KEY")
    proc = await start("serve", "--config", str(cfg), env=env)
    err = b""
    try:
        while line := await asyncio.wait_for(proc.stderr.readline(), 20):
            err += line
            assert b'"relay_listening"' not in line, "it started with the injected value"
        assert await proc.wait() == 2
    finally:
        await kill(proc)
    [failed] = [json.loads(x) for x in err.splitlines() if b"relay_start_failed" in x]
    assert failed["error"] == (
        f'{cfg}: upstream[0] (name "llm").auth_value_env: environment variable BAD_KEY: the '
        "value has control characters (CR, LF, ...) or blanks at its ends"
    )
    assert b"sk-bad" not in err and up.heads == []

    write("X-Key", "GOOD_KEY")
    proc = await start("serve", "--config", str(cfg), env=env)
    lines: list[bytes] = []

    async def reloaded() -> dict:  # the reload's outcome: config_reloaded or _reload_failed
        while True:
            line = await asyncio.wait_for(proc.stderr.readline(), 10)
            assert line, lines
            lines.append(line)
            if line.startswith(b"{") and json.loads(line)["event"].startswith("config_reload"):
                return json.loads(line)

    async def sent_key() -> bytes:
        resp = await httpc.fetch(port, "POST", "/v1/embeddings", {"model": "m", "input": "x"})
        assert resp.status == 200
        return up.heads[-1]

    try:
        port, seen = await wait_listening(proc)
        lines += [json.dumps(rec).encode() for rec in seen]
        assert b"\r\nX-Key: sk-good-123\r\n" in await sent_key()
        for header, var, key in (
            ("X-Key", "BAD_KEY", f'{cfg}: upstream[0] (name "llm").auth_value_env: '),
            ("X-Key\r\nX-Evil: 1", "GOOD_KEY", f'{cfg}: upstream[0] (name "llm").auth_header: '),
        ):
            write(header, var)
            proc.send_signal(signal.SIGHUP)
            rec = await reloaded()
            assert rec["event"] == "config_reload_failed" and rec["reason"].startswith(key)
            head = await sent_key()  # on the configuration it ran with
            assert b"\r\nX-Key: sk-good-123\r\n" in head and b"X-Evil" not in head
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), 15)
        assert await proc.wait() == 0
    finally:
        await kill(proc)
        await up.stop()
    log = b"".join(lines) + rest
    assert b"sk-bad" not in log and b"X-Evil" not in log and b"sk-good" not in log
    assert all(b"X-Evil" not in h for h in up.heads)
