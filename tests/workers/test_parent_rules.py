"""The parent's bookkeeping on its rarer paths, one rule a test, driven in this process with
a stand-in worker as in test_parent_state: what a crash row is charged, the budgets'
generation a reload records, an admission the store refused, and the slot of an admission
that holds nothing (its key has no limits)."""

from __future__ import annotations

import time

import pytest

from relay.observe.record import Record
from relay.observe.ui_state import Trended
from relay.policy.budget import BudgetExceeded
from relay.workers import wire
from tests.support.helpers import wait_for
from tests.workers.test_parent_state import (
    END_WAIT_S,
    _config,
    _parent,
    _worker,
    served,
    storing,
)

CHAT = "/v1/chat/completions"


def _key(**limits) -> list[dict]:
    return [{"id": "alpha", "sha256": "0" * 64, **limits}]


def _keyed(rid: str, ts: float | None = None) -> Record:
    rec = Record(time.time() if ts is None else ts, rid, CHAT, "POST", key_id="alpha")
    rec.upstream_requested = "llm"
    return rec


def _daily(app) -> tuple[int, int, int, int]:
    """The key's daily window: (requests, tokens) used, (requests, tokens) reserved."""
    u = app.budgets.usage("alpha", time.time())["daily"]
    return u["requests"], u["tokens"], u["reserved_requests"], u["reserved_tokens"]


def _told(w, kind) -> list:
    return [m for m in w.writer.told() if isinstance(m, kind)]


async def test_a_crash_row_is_charged_what_its_admission_reserved(tmp_path):
    """A worker dies with two admitted requests: each becomes a crash row, charged one
    request and the tokens its admission reserved (prompt + completion estimates), and
    holds nothing any more."""
    app = _parent(tmp_path, key=_key(requests_per_day=9, tokens_per_day=1000))
    w = _worker()
    async with storing(app):
        async with served(app, w) as reader:
            reader.feed_data(
                wire.frame(wire.Admit(7, 1, _keyed("r1"), 10, 20))
                + wire.frame(wire.Admit(8, 2, _keyed("r2"), 3, 4))
            )
            await wait_for(lambda: len(_told(w, wire.AdmitAnswer)) == 2, timeout=END_WAIT_S)
            assert _daily(app) == (0, 0, 2, 37)
        # The stand-in is gone (its stream ended, its process exited): the parent reclaimed.
        assert w.admissions == {}
        # Each its one request and its estimates: 1 + 1 requests, (10 + 20) + (3 + 4) tokens.
        assert _daily(app) == (2, 37, 0, 0)
    rows = app.store.query(
        "SELECT request_id, error_code, ok, prompt_tokens, completion_tokens, tokens_source"
        " FROM request ORDER BY request_id"
    )
    assert [tuple(r.values()) for r in rows] == [
        ("r1", "relay_crashed", 0, 10, 20, "reserved"),
        ("r2", "relay_crashed", 0, 3, 4, "reserved"),
    ]
    assert app.store.query("SELECT count(*) AS n FROM admission")[0]["n"] == 0


async def test_a_reload_records_the_budgets_generation_it_made(tmp_path):
    """The parent's reload records (when, the budgets' generation after it): a row without an
    admission is charged to the windows made by the reloads after its request began, and
    only to those."""
    app = _parent(tmp_path, key=_key())
    w = _worker()
    began = time.time()
    limited = _config(tmp_path, key=_key(requests_per_day=5))
    async with storing(app):
        await app.reload_async(limited)
        reloaded = time.time()
        assert app.budgets.generation == 1
        assert len(app.budget_generations) == 2
        at, generation = app.budget_generations[-1]
        assert began <= at <= reloaded and generation == 1
        async with served(app, w) as reader:
            # In flight across the reload: charged to the window it made.
            before = _keyed("r1", began)
            before.upstream_served, before.prompt_tokens, before.completion_tokens = "llm", 3, 4
            reader.feed_data(wire.frame(wire.Row(before, None, Trended.GENERATING)))
            await wait_for(lambda: len(app.ui_recent.ring) == 1, timeout=END_WAIT_S)
            assert _daily(app) == (1, 7, 0, 0)
            # Begun after it: that window is not the reload's to charge (the admission is).
            after = _keyed("r2", reloaded + 1)
            after.upstream_served, after.prompt_tokens, after.completion_tokens = "llm", 5, 6
            reader.feed_data(wire.frame(wire.Row(after, None, Trended.GENERATING)))
            await wait_for(lambda: len(app.ui_recent.ring) == 2, timeout=END_WAIT_S)
            assert _daily(app) == (1, 7, 0, 0)


@pytest.mark.parametrize("row_first", [False, True], ids=["refused", "row-then-refused"])
async def test_an_admission_the_store_refused_holds_nothing(tmp_path, monkeypatch, row_first):
    """A shared store refuses the admission record (the key is spent across the relays): the
    worker is told so, the reservation is given back, free, and the slot asked for with it
    too. A row that came first (the client left meanwhile) settled it already: once."""
    app = _parent(tmp_path, key=_key(requests_per_day=9))
    pool = app.upstreams["llm"].slots
    w = _worker()
    resets = time.time() + 3600

    async def refuse(*args, **kwargs) -> None:
        raise BudgetExceeded("daily_requests", 9, 1, 9, resets, time.time())

    monkeypatch.setattr(app.store, "admit", refuse)
    rec = _keyed("r1")
    frames = wire.frame(wire.Admit(7, 1, rec, 10, 20, wire.SlotAsk(11, "llm", 5.0)))
    if row_first:
        frames += wire.frame(wire.Row(rec, 1, Trended.GENERATING))
    async with storing(app), served(app, w) as reader:
        reader.feed_data(frames)
        await wait_for(lambda: _told(w, wire.AdmitRefused), timeout=END_WAIT_S)
        assert _told(w, wire.AdmitRefused) == [
            wire.AdmitRefused(7, "daily_requests", 9, 1, 9, resets)
        ]
        assert _told(w, wire.AdmitAnswer) == []
        assert w.admissions == {}
        assert _daily(app) == (0, 0, 0, 0)
        assert (pool.in_flight, w.held, w.waiting) == (0, {}, {})


@pytest.mark.parametrize("takes", [True, False], ids=["taken", "not-taken"])
async def test_a_no_limits_admission_takes_its_slot_and_holds_nothing(tmp_path, takes):
    """The parent's key has no limits (a reload removed them; the worker still had them): the
    admission is answered at once, no reservation held and no record written, but the slot
    asked for with it is granted all the same, and one the request did not take goes back
    with its row."""
    app = _parent(tmp_path, key=_key())
    pool = app.upstreams["llm"].slots
    w = _worker()
    rec = _keyed("r1")
    async with storing(app), served(app, w) as reader:
        reader.feed_data(wire.frame(wire.Admit(7, 1, rec, 10, 20, wire.SlotAsk(11, "llm", 5.0))))
        await wait_for(lambda: _told(w, wire.SlotAnswer), timeout=END_WAIT_S)
        assert _told(w, wire.AdmitAnswer) == [wire.AdmitAnswer(7, wire.AdmitVerdict.OK)]
        assert _told(w, wire.SlotAnswer) == [wire.SlotAnswer(11, wire.SlotVerdict.OK, member="llm")]
        assert (pool.in_flight, list(w.held), w.admissions) == (1, [11], {})
        rec.upstream_served = "llm" if takes else None
        done = wire.frame(wire.Free(11)) if takes else b""
        reader.feed_data(done + wire.frame(wire.Row(rec, 1, Trended.GENERATING)))
        await wait_for(lambda: len(app.ui_recent.ring) == 1, timeout=END_WAIT_S)
        assert (pool.in_flight, w.held) == (0, {})
    assert app.store.query("SELECT count(*) AS n FROM admission")[0]["n"] == 0
    assert [r["request_id"] for r in app.store.query("SELECT request_id FROM request")] == ["r1"]
