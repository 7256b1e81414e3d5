"""The parent's side of the workers' messages, driven in this process with a stand-in worker
(a reader fed with frames, a process that exits when the test ends): the order of a worker's
messages is the order they count in, and a worker that is gone is counted once.

The parent's reader of a worker ends only once that worker's process has exited
(`ParentApp._lost` awaits it). A test that fails before its stand-in exits would leave that
reader waiting for ever, and the event loop's teardown with it, past pytest-timeout: `served`
ends the stand-in however the test ends, and bounds the wait for its reader."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from relay.config import Config, parse_config
from relay.errors import Outcome
from relay.observe.log import quiet
from relay.observe.metrics import Registry, UpstreamMetrics
from relay.observe.record import Record, field_values
from relay.observe.ui_state import Trended
from relay.workers import holdings, wire
from relay.workers.holdings import Worker
from relay.workers.parent import ParentApp
from tests.support.helpers import wait_for

# How long the parent may take to end a stand-in's reader once its stream and process end.
END_WAIT_S = 10.0


class _Proc:
    def __init__(self) -> None:
        self.exited = asyncio.Event()
        self.returncode: int | None = None
        self.pid = 1

    async def wait(self) -> int:
        await self.exited.wait()
        self.returncode = -9
        return -9


class _Writer:
    """The parent's end of a stand-in's socket: it keeps what the parent writes (`told`)."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def told(self) -> list:
        """Every message the parent wrote to the stand-in, in order."""
        out, at = [], 0
        while at < len(self.sent):
            n = int.from_bytes(self.sent[at : at + 4], "big")
            out.append(wire.FROM_PARENT.decode(bytes(self.sent[at + 4 : at + 4 + n])))
            at += 4 + n
        return out


def _worker(index: int = 0) -> Worker:
    return Worker(index, _Proc(), _Writer(), time.monotonic())


def _config(tmp_path, **cfg) -> Config:
    return parse_config(
        {
            "server": {"port": 0},
            "store": {"path": str(tmp_path / "relay.db")},
            "dispatcher": {"health_interval_s": 0},
            "upstream": [{"name": "llm", "url": "http://127.0.0.1:9", "parallel": 4}],
            **cfg,
        }
    )


def _parent(tmp_path, **cfg) -> ParentApp:
    app = ParentApp(_config(tmp_path, **cfg), quiet(), 2)
    app.loop = asyncio.get_running_loop()
    return app


@contextlib.asynccontextmanager
async def served(app: ParentApp, w: Worker) -> AsyncIterator[asyncio.StreamReader]:
    """The parent reads `w`'s messages from the reader given (fed by the test). However the
    block ends: the stream ends, the stand-in exits, and its reader has ended within
    END_WAIT_S (an error the reader met is raised here). The end is not a crash to restart:
    the parent is draining from then on."""
    reader = asyncio.StreamReader()
    serving = asyncio.create_task(app._serve_worker(w, reader))
    try:
        yield reader
    finally:
        reader.feed_eof()
        app.draining = True
        w.proc.exited.set()
        await asyncio.wait_for(serving, END_WAIT_S)


@contextlib.asynccontextmanager
async def storing(app: ParentApp) -> AsyncIterator[None]:
    """The parent's store runs for the block; its tasks (admission commits) are done, or
    given up, before the store closes."""
    app.store.start()
    try:
        yield
    finally:
        pending = {t for t in app.tasks if not t.done()}
        if pending:
            await asyncio.wait(pending, timeout=END_WAIT_S)
        await app.store.aclose()


async def test_a_row_right_behind_its_admission_settles_it(tmp_path):
    """The client left during the admission round trip: the row follows the admit at once,
    in one read. The reservation is taken before the row is read, and the row settles it:
    nothing held, no crash row later."""
    app = _parent(tmp_path, key=[{"id": "alpha", "sha256": "0" * 64, "requests_per_day": 3}])
    w = _worker()
    rec = Record(time.time(), "r1", "/v1/chat/completions", "POST", key_id="alpha")
    gone = Record(*field_values(rec))
    gone.outcome, gone.error_code = Outcome.CLIENT_CLOSED, "client_gone"
    async with storing(app):
        async with served(app, w) as reader:
            reader.feed_data(
                wire.frame(wire.Admit(7, 1, rec, 10, 20))
                + wire.frame(wire.Row(gone, 1, Trended.GENERATING))
            )
        # (the reader has ended: it took both messages, the row right after the admit)
        assert w.admissions == {}
        usage = app.budgets.usage("alpha", time.time())["daily"]
        assert (usage["reserved_requests"], usage["requests"]) == (0, 0)  # not served: free
    rows = app.store.query("SELECT request_id, error_code FROM request")
    assert [(r["request_id"], r["error_code"]) for r in rows] == [("r1", "client_gone")]
    assert app.store.query("SELECT count(*) AS n FROM admission")[0]["n"] == 0


def _figures(requests: int, flm: float | None = None) -> Registry:
    reg = Registry()
    m = UpstreamMetrics("llm", 4)
    for _ in range(requests):
        m.request_done(True, None)
    m.set_flm(flm, None)
    reg.add(m)
    return reg


async def test_a_lost_worker_is_summed_once_and_live_figures_win(tmp_path):
    app = _parent(tmp_path)
    app.draining = True  # (no restart here)
    dead, live = _worker(0), _worker(1)
    dead.figures = _figures(7, flm=11.0)
    live.figures = _figures(5, flm=99.0)
    app.workers = {0: dead, 1: live}
    lost = asyncio.create_task(app._lost(dead))
    try:
        # Its figures are kept before it waits for the process to be reaped.
        await wait_for(lambda: app.lost_figures is not None, timeout=END_WAIT_S)
        assert app.workers == {1: live}
        await app.gather()  # (no live worker answers: `ready` is not set, their figures stand)
        m = app.registry.get("llm")
        assert m.requests_total == 12  # the dead one's 7 once (in the base), the live one's 5
        assert m.decoding_speed_tps == 99.0  # a live worker's last-seen figure, not the dead one's
    finally:
        dead.proc.exited.set()
        await asyncio.wait_for(lost, END_WAIT_S)
    await app.gather()
    assert app.registry.get("llm").requests_total == 12


async def test_a_key_given_limits_by_a_reload_is_charged_what_was_in_flight(tmp_path):
    """As in one process: a request of a key without limits, in flight when a reload gives the
    key a daily limit, is charged to the new window when its row comes (the window was
    rebuilt from the rows committed before)."""
    from relay.config import KeyConfig

    app = _parent(tmp_path, key=[{"id": "alpha", "sha256": "0" * 64}])
    w = _worker()
    began = time.time()
    rec = Record(began, "r1", "/v1/chat/completions", "POST", key_id="alpha")
    rec.upstream_served, rec.status, rec.ok = "llm", 200, True
    rec.prompt_tokens, rec.completion_tokens = 3, 4
    limited = [KeyConfig(id="alpha", sha256="0" * 64, requests_per_day=5)]
    app.budgets.reload(limited, {("alpha", "daily"): (0, 0)}, time.time())
    app.budget_generations.append((time.time(), app.budgets.generation))
    holdings.row(app, w, wire.Row(rec, None, Trended.GENERATING))
    usage = app.budgets.usage("alpha", time.time())["daily"]
    assert (usage["requests"], usage["tokens"]) == (1, 7)
    # a request that began after the reload was reserved (and charged) under it: not again
    later = Record(time.time() + 1, "r2", "/v1/chat/completions", "POST", key_id="alpha")
    later.upstream_served = "llm"
    holdings.row(app, w, wire.Row(later, None, Trended.GENERATING))
    assert app.budgets.usage("alpha", time.time())["daily"]["requests"] == 1


async def test_a_keyed_request_s_slot_comes_with_its_admission_and_goes_with_its_row(tmp_path):
    """One round trip for both: the admit carries the slot it asks for; a slot the request
    did not take (its first upstream was down, it failed first) goes back with its row."""
    app = _parent(tmp_path, key=[{"id": "alpha", "sha256": "0" * 64, "requests_per_day": 9}])
    pool = app.upstreams["llm"].slots
    w = _worker()
    async with storing(app), served(app, w) as reader:
        for adm_id, slot_id, takes in ((1, 11, True), (2, 12, False)):
            rec = Record(time.time(), f"r{adm_id}", "/v1/chat/completions", "POST", key_id="alpha")
            rec.upstream_requested = "llm"
            ahead = wire.SlotAsk(slot_id, "llm", 5.0)
            reader.feed_data(wire.frame(wire.Admit(adm_id, adm_id, rec, 1, 2, ahead)))
            # Granted with the admission.
            await wait_for(lambda: slot_id in w.held, timeout=END_WAIT_S)  # noqa: B023
            assert pool.in_flight == 1
            rec.upstream_served = "llm" if takes else None
            done = [wire.frame(wire.Free(slot_id))] if takes else []  # (released at settle)
            reader.feed_data(b"".join(done) + wire.frame(wire.Row(rec, adm_id, Trended.GENERATING)))
            await wait_for(lambda: adm_id not in w.admissions, timeout=END_WAIT_S)  # noqa: B023
            assert pool.in_flight == 0 and w.held == {} and w.admissions == {}
        usage = app.budgets.usage("alpha", time.time())["daily"]
        assert (usage["requests"], usage["reserved_requests"]) == (1, 0)
        slots = [m for m in w.writer.told() if isinstance(m, wire.SlotAnswer)]
        assert slots == [wire.SlotAnswer(i, wire.SlotVerdict.OK, member="llm") for i in (11, 12)]


def test_each_worker_its_own_telemetry_instance_and_the_parent_s_code():
    from relay.workers.parent import worker_environ

    given = {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod", "PYTHONPATH": "/x"}
    one, two = worker_environ(given, 0), worker_environ(given, 1)
    a, b = (e["OTEL_RESOURCE_ATTRIBUTES"].split(",") for e in (one, two))
    assert a[0] == b[0] == "deployment.environment=prod"  # the operator's, first
    assert a[1].startswith("service.instance.id=") and a[1].endswith(":worker-0")
    assert b[1].endswith(":worker-1") and a[1] != b[1]
    import relay

    home = str(__import__("pathlib").Path(relay.__file__).resolve().parent.parent)
    assert one["PYTHONPATH"].split(":") == [home, "/x"]  # (the worker runs with -P)
    assert given["PYTHONPATH"] == "/x"  # (the parent's own is left as it was)
