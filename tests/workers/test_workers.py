"""`relay serve --workers N` over real sockets and real processes: whatever worker a request
lands on, slots, queues, budgets, rows, health and metrics are the whole relay's, as with one
process; a worker killed with -9 is replaced and what it held is given back; the parent
killed with -9 leaves no worker behind."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay.sim.server import Simulator
from tests.app.test_shutdown import rows as stored
from tests.app.test_signals import Tail
from tests.support import httpc
from tests.support.helpers import LOOP_EARLY_MS, wait_for
from tests.support.keys import SECRET, sha
from tests.support.processes import alive, established, kill, socket_inodes, start, wait_listening

CHAT = "/v1/chat/completions"
pytestmark = pytest.mark.timeout(120)
# A generous deadline for what the relay is waited for to do, on a busy machine.
WAIT_S = 30.0


class CountingSim(Simulator):
    """A simulator that remembers the most generations it ran at once."""

    peak = 0
    _active = 0

    @property
    def active_generations(self) -> int:  # type: ignore[override]
        return self._active

    @active_generations.setter
    def active_generations(self, n: int) -> None:
        self._active = n
        self.peak = max(self.peak, n)


def _config(
    path, db: str, port: int, *, parallel=8, queue=64, key_limit=None, up2=None, health=0.2
):
    text = (
        f'[server]\nport = 0\ndrain_timeout_s = 20\n[store]\npath = "{db}"\n'
        f"[dispatcher]\npool_timeout_s = 30\nhealth_interval_s = {health}\n"
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{port}"\n'
        f"parallel = {parallel}\nqueue = {queue}\n"
    )
    if up2 is not None:
        text += (
            f'[[upstream]]\nname = "second"\nurl = "http://127.0.0.1:{up2}"\nmodels = ["other"]\n'
        )
    if key_limit is not None:
        text += f'[[key]]\nid = "alpha"\nsha256 = "{sha(SECRET)}"\nrequests_per_day = {key_limit}\n'
    path.write_text(text)


async def _serve(tmp_path, workers: int, sim_port: int, **cfg):
    path, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
    _config(path, db, sim_port, **cfg)
    proc = await start("serve", "--config", str(path), "--workers", str(workers))
    port, seen = await wait_listening(proc)
    pids = next(r["pids"] for r in seen if r["event"] == "workers_serving")
    assert len(pids) == workers
    return proc, port, db, path, Tail(proc), pids


async def _stop(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), 40)


def _metric(text: str, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


async def _metrics(port: int) -> str:
    resp = await httpc.fetch(port, "GET", "/metrics")
    assert resp.status == 200
    return resp.body.decode()


async def _until(read, ok, what: str):
    """`await read()` once `ok` holds of it, within WAIT_S (else it fails, naming `what` and
    the last value read)."""
    deadline = time.monotonic() + WAIT_S
    while not ok(value := await read()):
        assert time.monotonic() < deadline, f"{what}: {value!r} after {WAIT_S} s"
        await asyncio.sleep(0.05)
    return value


async def _figure(port: int, name: str, **labels) -> float:
    return _metric(await _metrics(port), name, **labels)


async def _counted(port: int, want: float, name: str, **labels) -> str:
    """The /metrics text once the counter `name` has reached `want`. The parent sums each
    worker's figures as that worker last answered: one that does not answer a gathering in
    time (FIGURES_WAIT_S) counts with its older figures, so a count the test knows is waited
    for, not read once. The counters only grow: from then on every scrape has them all."""
    await _until(lambda: _figure(port, name, **labels), lambda n: n >= want, f"{name} {labels}")
    return await _metrics(port)


async def _ui_state(port: int) -> dict:
    resp = await httpc.fetch(port, "GET", "/api/ui/state")
    assert resp.status == 200
    return resp.json()


async def _charged(port: int) -> int:
    """The requests the key `alpha`'s daily window has charged, as the relay's page says."""
    (alpha,) = (await _ui_state(port))["budgets"]
    (daily,) = alpha["windows"]
    assert (alpha["key"], daily["window"]) == ("alpha", "daily")
    return daily["requests"]


def _sim_chats(sim) -> int:
    return len([r for r in sim.requests if r.path == CHAT])


def _served_by(proc_pids: list[int]) -> None:
    for pid in proc_pids:
        os.kill(pid, 0)  # (each is alive)


@pytest.mark.parametrize("workers", [2, 3])
async def test_a_daily_limit_admits_exactly_k_across_workers(tmp_path, workers):
    sim = Simulator()
    await sim.start()
    proc, port, db, _, _, _ = await _serve(tmp_path, workers, sim.port, key_limit=10)
    try:
        auth = {"Authorization": f"Bearer {SECRET}"}
        results = await asyncio.gather(
            *(
                httpc.fetch(port, "POST", CHAT, httpc.chat(2, stream=False), auth)
                for _ in range(300)
            )
        )
        statuses = sorted(r.status for r in results)
        assert statuses.count(200) == 10 and statuses.count(429) == 290
        assert len([r for r in sim.requests if r.path == CHAT]) == 10
        # The parent's refusal, as the worker answers it: what was used and what was asked.
        refused = next(r for r in results if r.status == 429).json()["error"]
        assert refused["message"] == "daily_requests budget exceeded: 10 used + 1 requested > 10"
        assert (refused["details"]["used"], refused["details"]["requested"]) == (10, 1)
        # Every worker's figures of the 300 are in: the served and the refused apart.
        await _counted(port, 10, "relay_key_requests_total", key="alpha", outcome="served")
        text = await _counted(port, 290, "relay_key_requests_total", key="alpha", outcome="refused")
        assert _metric(text, "relay_key_requests_total", key="alpha", outcome="served") == 10
        assert _metric(text, "relay_requests_total", upstream="llm") == 10
        assert _metric(text, "relay_requests_rejected_total", code="budget_exceeded") == 290
        assert await _stop(proc) == 0
        rows = stored(db)
        assert len(rows) == 300  # one row per request, in the one store
        assert sorted(r["status"] for r in rows) == statuses
        assert len({r["request_id"] for r in rows}) == 300
    finally:
        await kill(proc)
        await sim.stop()


@pytest.mark.parametrize("workers", [2, 3])
async def test_parallel_is_relay_wide(tmp_path, workers):
    sim = CountingSim()
    await sim.start()
    proc, port, db, _, _, _ = await _serve(tmp_path, workers, sim.port, parallel=2, queue=100)
    try:
        results = await asyncio.gather(
            *(httpc.fetch(port, "POST", CHAT, httpc.chat(4, interval_ms=15)) for _ in range(30))
        )
        assert [r.status for r in results] == [200] * 30
        assert all(r.data_events()[-1] == "[DONE]" for r in results)
        assert sim.peak == 2  # never 3 generations at once, whichever worker took them
        text = await _counted(port, 30, "relay_requests_total", upstream="llm")
        assert _metric(text, "relay_requests_total", upstream="llm") == 30
        assert _metric(text, "relay_slots_in_flight", upstream="llm") == 0
        assert _metric(text, "relay_queue_waiting", upstream="llm") == 0
        assert await _stop(proc) == 0
        assert len(stored(db)) == 30
    finally:
        await kill(proc)
        await sim.stop()


async def _holding(port: int) -> asyncio.StreamWriter:
    """A stream under way that holds its slot until the test closes it (its generation
    would take minutes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(httpc.build_request("POST", CHAT, httpc.chat(5000, interval_ms=20)))
    head = await asyncio.wait_for(httpc.read_head(reader), WAIT_S)
    assert head.status == 200
    return writer


async def test_waiting_requests_are_served_in_arrival_order(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, _, _, _, _ = await _serve(tmp_path, 3, sim.port, parallel=1, queue=20)
    try:
        holder = await _holding(port)
        waiting = []
        queued = functools.partial(_figure, port, "relay_queue_waiting", upstream="llm")
        for i in range(8):  # each on a new connection: the kernel picks the worker
            body = httpc.chat(1, stream=False)
            body["messages"][0]["content"] = f"order {i}"
            waiting.append(
                asyncio.create_task(httpc.fetch(port, "POST", CHAT, body, timeout=WAIT_S))
            )
            # Queued relay-wide before the next one is sent.
            await _until(queued, lambda q: q == i + 1, f"request {i} queued")  # noqa: B023
        holder.close()  # the slot goes to the first in the queue
        assert [r.status for r in await asyncio.gather(*waiting)] == [200] * 8
        order = [
            r.json["messages"][0]["content"]
            for r in sim.requests
            if r.path == CHAT and r.json["messages"][0]["content"].startswith("order")
        ]
        assert order == [f"order {i}" for i in range(8)]
    finally:
        await kill(proc)
        await sim.stop()


async def test_queue_full_is_503_across_workers(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, _, _, _, _ = await _serve(tmp_path, 2, sim.port, parallel=1, queue=2)
    try:
        # One serving, two queued: the queue is full, whichever worker the next land on.
        holder = await _holding(port)
        body = httpc.chat(2, stream=False)
        queued = [
            asyncio.create_task(httpc.fetch(port, "POST", CHAT, body, timeout=WAIT_S))
            for _ in range(2)
        ]
        waiting = functools.partial(_figure, port, "relay_queue_waiting", upstream="llm")
        await _until(waiting, lambda q: q == 2, "two requests queued")
        busy = await asyncio.gather(*(httpc.fetch(port, "POST", CHAT, body) for _ in range(5)))
        assert [r.status for r in busy] == [503] * 5
        assert all(r.header("retry-after") for r in busy)
        assert {r.json()["error"]["code"] for r in busy} == {"upstream_busy"}
        holder.close()
        assert [r.status for r in await asyncio.gather(*queued)] == [200, 200]
    finally:
        await kill(proc)
        await sim.stop()


async def test_sighup_switches_every_worker_or_none(tmp_path):
    sim_a, sim_b = Simulator(), Simulator()
    await sim_a.start()
    await sim_b.start()
    proc, port, db, path, log, _ = await _serve(tmp_path, 3, sim_a.port)
    try:
        body = httpc.chat(1, stream=False, model="other")
        before = await asyncio.gather(*(httpc.fetch(port, "POST", CHAT, body) for _ in range(12)))
        assert {r.status for r in before} == {200}  # (one upstream: it serves every model)
        _config(path, db, sim_a.port, up2=sim_b.port)
        mark = len(log.lines)
        proc.send_signal(signal.SIGHUP)
        rec = await log.wait("config_reloaded", mark, timeout=WAIT_S)
        assert rec["added"] == ["second"]
        after = await asyncio.gather(*(httpc.fetch(port, "POST", CHAT, body) for _ in range(24)))
        assert {r.status for r in after} == {200}
        assert len([r for r in sim_b.requests if r.path == CHAT]) == 24  # every worker sees it
        # a bad file: refused, every worker keeps serving the running configuration
        path.write_text(path.read_text() + "[server\n")
        mark = len(log.lines)
        proc.send_signal(signal.SIGHUP)
        await log.wait("config_reload_failed", mark, timeout=WAIT_S)
        again = await asyncio.gather(*(httpc.fetch(port, "POST", CHAT, body) for _ in range(12)))
        assert {r.status for r in again} == {200}
        assert len([r for r in sim_b.requests if r.path == CHAT]) == 36
        # removed again: no worker sends there any more
        _config(path, db, sim_a.port)
        mark = len(log.lines)
        proc.send_signal(signal.SIGHUP)
        rec = await log.wait("config_reloaded", mark, timeout=WAIT_S)
        assert rec["removed"] == ["second"]
        last = await asyncio.gather(*(httpc.fetch(port, "POST", CHAT, body) for _ in range(12)))
        assert {r.status for r in last} == {200}
        assert len([r for r in sim_b.requests if r.path == CHAT]) == 36
        assert not [e for e in log.lines if e["event"] == "worker_reload_failed"]
    finally:
        await kill(proc)
        await sim_a.stop()
        await sim_b.stop()


async def _stream(port: int, headers: dict, tokens: int = 60, heads: list | None = None):
    """A stream read to its end, or until the relay's connection breaks: (status, events,
    whole). `heads`: its head goes there once read (the stream is under way)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(httpc.build_request("POST", CHAT, httpc.chat(tokens, interval_ms=25), headers))
        head = await asyncio.wait_for(httpc.read_head(reader), WAIT_S)
        if heads is not None:
            heads.append(head)
        try:
            await asyncio.wait_for(httpc.read_body(reader, head), WAIT_S)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        return head
    finally:
        writer.close()


def _clients_of(pid: int, port: int) -> int:
    """How many client connections to `port` the process `pid` holds (established)."""
    return len(established(port).keys() & socket_inodes(pid))


async def test_a_worker_killed_mid_stream_is_replaced_and_gives_back_what_it_held(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, db, _, log, pids = await _serve(tmp_path, 2, sim.port, parallel=6, key_limit=100)
    try:
        auth = {"Authorization": f"Bearer {SECRET}"}
        before = _metric(await _metrics(port), "relay_requests_total", upstream="llm")
        heads: list = []
        streams = [asyncio.create_task(_stream(port, auth, heads=heads)) for _ in range(6)]
        await wait_for(lambda: len(heads) == 6, timeout=WAIT_S)  # every stream is under way
        # Which worker holds which streams is the kernel's choice: the one killed holds some.
        await wait_for(lambda: sum(_clients_of(p, port) for p in pids) == 6, timeout=WAIT_S)
        victim = max(pids, key=lambda p: _clients_of(p, port))
        held = _clients_of(victim, port)
        mark = len(log.lines)
        os.kill(victim, signal.SIGKILL)
        restarted = await log.wait("worker_restarted", mark, timeout=WAIT_S)
        assert restarted["pid"] not in pids
        lost = next(e for e in log.lines[mark:] if e["event"] == "worker_lost")
        assert (lost["pid"], lost["crash_rows"]) == (victim, held)
        results = await asyncio.gather(*streams)
        whole = [r for r in results if r.complete]
        assert len(whole) == 6 - held  # the victim's streams are cut, none of the others'
        for r in whole:  # the other worker's streams are untouched, byte-exact
            text = "".join(
                e["choices"][0]["delta"].get("content") or ""
                for e in r.data_events()
                if e != "[DONE]" and e["choices"]
            )
            assert text == httpc.sim_text(60)
        # Every slot is back once the other worker's streams have settled: 6 more are served
        # at once.
        in_flight = functools.partial(_figure, port, "relay_slots_in_flight", upstream="llm")
        await _until(in_flight, lambda n: n == 0, "slots in flight")
        again = await asyncio.gather(
            *(httpc.fetch(port, "POST", CHAT, httpc.chat(2, stream=False), auth) for _ in range(6))
        )
        assert [r.status for r in again] == [200] * 6
        # The victim's figures stay in: it finished none of its streams, the others count.
        served = before + len(whole) + 6
        text = await _counted(port, served, "relay_requests_total", upstream="llm")
        assert _metric(text, "relay_requests_total", upstream="llm") == served
        await _until(in_flight, lambda n: n == 0, "slots in flight")
        # The budget charged every request, the crash rows theirs: 6 + 6 of 100.
        await _until(lambda: _charged(port), lambda n: n >= 12, "alpha's daily requests")
        assert await _charged(port) == 12
        assert await _stop(proc) == 0
        rows = stored(db)
        crashed = [r for r in rows if r["error_code"] == "relay_crashed"]
        assert len(crashed) == held and len(rows) == 12
        assert all(r["tokens_source"] == "reserved" for r in crashed)
    finally:
        await kill(proc)
        await sim.stop()


async def test_the_parent_killed_leaves_no_worker_and_frees_the_port(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, db, path, _, pids = await _serve(tmp_path, 3, sim.port, key_limit=100)
    again = None
    try:
        auth = {"Authorization": f"Bearer {SECRET}"}
        heads: list = []
        stream = asyncio.create_task(_stream(port, auth, tokens=200, heads=heads))
        await wait_for(lambda: heads, timeout=WAIT_S)
        proc.kill()
        await proc.wait()
        # The kernel ends every worker with the parent: none is left, none drains its stream.
        await wait_for(lambda: not any(alive(p) for p in pids), timeout=WAIT_S)
        assert not (await asyncio.wait_for(stream, WAIT_S)).complete
        with socket.socket() as s:  # nothing holds the port: a new relay could listen there
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
        # the next start recovers the stream's admission record as after any crash
        again = await start("serve", "--config", str(path), "--workers", "2")
        _, seen = await wait_listening(again)
        assert [e["rows"] for e in seen if e["event"] == "admissions_recovered"] == [1]
        assert await _stop(again) == 0
        crashed = [r for r in stored(db) if r["error_code"] == "relay_crashed"]
        assert len(crashed) == 1 and crashed[0]["key_id"] == "alpha"
    finally:
        await kill(proc)
        if again is not None:
            await kill(again)
        await sim.stop()


async def test_sigterm_drains_every_worker_and_flushes_the_rows(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, db, _, log, _ = await _serve(tmp_path, 2, sim.port)
    try:
        streams = [asyncio.create_task(_stream(port, {}, tokens=20)) for _ in range(4)]
        await wait_for(lambda: _sim_chats(sim) == 4, timeout=WAIT_S)
        assert await _stop(proc) == 0
        results = await asyncio.gather(*streams)
        assert all(r.complete and r.data_events()[-1] == "[DONE]" for r in results)
        rows = stored(db)
        assert len(rows) == 4 and all(r["ok"] == 1 for r in rows)
        # (the process has exited; its last lines may still be on their way to the reader)
        assert (await log.wait("relay_stopped", timeout=WAIT_S))["rows_written"] == 4
    finally:
        await kill(proc)
        await sim.stop()


async def test_metrics_are_the_whole_relay_whichever_worker_answers(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, _, _, log, pids = await _serve(tmp_path, 3, sim.port)
    try:
        await asyncio.gather(
            *(httpc.fetch(port, "POST", CHAT, httpc.chat(3, stream=False)) for _ in range(40))
        )
        # The parent has every worker's figures of the 40 (and keeps them: a worker that
        # misses a gathering counts with its last), their rows before them.
        await _counted(port, 40, "relay_requests_total", upstream="llm")
        for _ in range(6):  # each scrape on a new connection: any worker answers it
            text = await _metrics(port)
            assert _metric(text, "relay_requests_total", upstream="llm") == 40
            assert _metric(text, "relay_tokens_total", upstream="llm") == 120
            e2e = _metric(text, "relay_e2e_request_latency_seconds_count", upstream="llm")
            assert e2e == 40
        slots = (await httpc.fetch(port, "GET", "/api/slots/metrics")).json()
        assert slots["llm"]["requests_total"] == 40
        state = (await httpc.fetch(port, "GET", "/api/ui/state")).json()
        assert len(state["recent"]) == 40
        # every worker killed in turn (whichever served what): the counters do not go back
        for pid in pids:
            mark = len(log.lines)
            os.kill(pid, signal.SIGKILL)
            await log.wait("worker_restarted", mark, timeout=WAIT_S)
            text = await _metrics(port)
            assert _metric(text, "relay_requests_total", upstream="llm") == 40
            assert _metric(text, "relay_e2e_request_latency_seconds_count", upstream="llm") == 40
        await asyncio.gather(
            *(httpc.fetch(port, "POST", CHAT, httpc.chat(3, stream=False)) for _ in range(10))
        )
        text = await _counted(port, 50, "relay_requests_total", upstream="llm")
        assert _metric(text, "relay_requests_total", upstream="llm") == 50
    finally:
        await kill(proc)
        await sim.stop()


# Probes counted: one prober needs (PROBES - 1) intervals for them, three a third of that.
PROBES = 10


def _probes(sim) -> int:
    return len([r for r in sim.requests if r.path == "/health"])


async def test_one_health_probe_per_upstream_and_every_worker_told(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, _, _, _, _ = await _serve(tmp_path, 3, sim.port)
    try:
        # One prober waits health_interval_s (0.2, less a loop tick) after each answer: over
        # a window the test measures it sends at most one probe per interval, and one more;
        # and one it sent before is counted in the window when it arrives there. Three
        # probers would send three times as many.
        interval = 0.2 - LOOP_EARLY_MS / 1000
        t0 = time.monotonic()
        first = _probes(sim)
        await wait_for(lambda: _probes(sim) >= first + PROBES, timeout=WAIT_S)
        counted = _probes(sim) - first
        window = time.monotonic() - t0
        assert counted <= window / interval + 2, (counted, window)
        await sim.stop()  # the upstream goes away: every worker fails fast
        # The next probe finds it down, and the parent tells every worker as it takes the
        # verdict: once the parent's figure says so, every worker has been told.
        up = functools.partial(_figure, port, "relay_upstream_up", upstream="llm")
        await _until(up, lambda n: n == 0, "relay_upstream_up")
        results = await asyncio.gather(
            *(httpc.fetch(port, "POST", CHAT, httpc.chat(2, stream=False)) for _ in range(9))
        )
        assert {r.status for r in results} == {502}
        assert {r.json()["error"]["code"] for r in results} == {"upstream_unavailable"}
        # failed fast on the probe's verdict, which every worker was told
        assert all("is down" in r.json()["error"]["message"] for r in results)
        text = await _metrics(port)
        assert _metric(text, "relay_upstream_up", upstream="llm") == 0
    finally:
        await kill(proc)
        await sim.stop()


async def test_a_second_sigterm_ends_every_drain_at_once_rows_still_flushed(tmp_path):
    sim = Simulator()
    await sim.start()
    proc, port, db, _, log, _ = await _serve(tmp_path, 2, sim.port)
    try:
        streams = [asyncio.create_task(_stream(port, {}, tokens=400)) for _ in range(3)]
        await wait_for(lambda: _sim_chats(sim) == 3, timeout=WAIT_S)
        proc.send_signal(signal.SIGTERM)
        await log.wait("relay_draining", timeout=WAIT_S)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0
        # The streams had 10 s to go and the drain 20 s: cut, not waited for.
        results = await asyncio.gather(*streams)
        assert not any(r.complete for r in results)
        rows = stored(db)
        assert len(rows) == 3 and all(r["ok"] == 0 for r in rows)
    finally:
        await kill(proc)
        await sim.stop()


async def test_workers_that_cannot_start_fail_the_start_and_leave_nothing(tmp_path):
    broken = tmp_path / "site"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(
        "import os, sys\nif 'relay.workers.worker' in sys.orig_argv:\n    os._exit(7)\n"
    )
    path, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
    _config(path, db, 9)
    proc = await start(
        "serve", "--config", str(path), "--workers", "2", env={"PYTHONPATH": str(broken)}
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 40)
        assert proc.returncode == 2
        failed = [line for line in err.decode().splitlines() if "relay_start_failed" in line]
        assert failed and "worker 0 did not start (exit code 7)" in failed[0]
    finally:
        await kill(proc)


async def test_sigterm_to_every_process_of_the_tree_is_one_drain(tmp_path):
    """systemd (KillMode=control-group) and `pkill` signal the parent and every worker at
    once: that is one drain, not a drain and a hurry; the streams finish whole."""
    sim = Simulator()
    await sim.start()
    proc, port, db, _, _, pids = await _serve(tmp_path, 2, sim.port)
    try:
        streams = [asyncio.create_task(_stream(port, {}, tokens=12)) for _ in range(4)]
        await wait_for(lambda: _sim_chats(sim) == 4, timeout=WAIT_S)
        for pid in [proc.pid, *pids]:
            os.kill(pid, signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 40) == 0
        results = await asyncio.gather(*streams)
        assert all(r.complete and r.data_events()[-1] == "[DONE]" for r in results)
        assert len(stored(db)) == 4
    finally:
        await kill(proc)
        await sim.stop()


async def test_without_probes_a_down_upstream_is_up_again_in_the_figures(tmp_path):
    """health_interval_s = 0: a worker that found the upstream down, then got an answer from
    it, says so: the relay's figures follow (no probe would)."""
    sim = Simulator()
    await sim.start()
    sim_port = sim.port
    await sim.stop()
    proc, port, _, _, _, _ = await _serve(tmp_path, 2, sim_port, health=0)
    try:
        failed = await asyncio.gather(
            *(httpc.fetch(port, "POST", CHAT, httpc.chat(1, stream=False)) for _ in range(4))
        )
        assert {r.status for r in failed} == {502}
        assert _metric(await _metrics(port), "relay_upstream_up", upstream="llm") == 0
        sim = Simulator(port=sim_port)
        await sim.start()
        ok = await asyncio.gather(
            *(httpc.fetch(port, "POST", CHAT, httpc.chat(1, stream=False)) for _ in range(8))
        )
        assert {r.status for r in ok} == {200}
        assert _metric(await _metrics(port), "relay_upstream_up", upstream="llm") == 1
    finally:
        await kill(proc)
        await sim.stop()


async def test_an_address_in_use_fails_the_start_with_workers_too(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path, db = tmp_path / "relay.toml", str(tmp_path / "relay.db")
        _config(path, db, 9)
        proc = await start("serve", "--config", str(path), "--workers", "2", "--port", str(port))
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 40)
            assert proc.returncode == 2
            assert b"relay_start_failed" in err and b"workers_serving" not in err
        finally:
            await kill(proc)
