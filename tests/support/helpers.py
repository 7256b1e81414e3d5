"""The small helpers many test modules use: bounded waits, a refused port, a relay's rows, the
relay's own error bodies, the slots endpoint, streamed contents."""

from __future__ import annotations

import asyncio
import socket

from relay.store.schema import COLUMNS
from tests.support import httpc

CHAT = "/v1/chat/completions"
# A delay on a loop's clock (uvloop: whole milliseconds, read once per loop turn), such as the
# simulator's pacing or the relay's stall guard, may end up to two ticks early as
# perf_counter, the rows' clock, sees it: a floor on a row's timing allows for that.
LOOP_EARLY_MS = 2


async def wait_for(predicate, timeout: float = 5.0, step: float = 0.005):
    """Poll a condition the code under test makes true (bounded, fails loudly)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step)


async def settled(read, quiet: float = 0.15, timeout: float = 5.0):
    """The value of `read()` once it has stopped changing for `quiet` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    last, since = read(), loop.time()
    while loop.time() - since < quiet:
        assert loop.time() < end, "value never settled"
        await asyncio.sleep(0.01)
        value = read()
        if value != last:
            last, since = value, loop.time()
    return last


_HELD: dict[int, socket.socket] = {}  # the closed ports' sockets, kept until released


def closed_port() -> int:
    """A port where nothing listens: a connect to it is refused. It stays bound (never
    listening) until `release`, so no server started meanwhile (the relay under test itself,
    binding port 0) can be given it, which would turn a dead upstream into a live one."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    _HELD[port] = s
    return port


def release(port: int) -> int:
    """A `closed_port` given back, for a server the test starts on it now."""
    s = _HELD.pop(port, None)
    if s is not None:
        s.close()
    return port


# ---- a relay's request rows ---------------------------------------------------------------------
def rows(app, where: str = "", params=()) -> list[dict]:
    """The request rows now (flushed first), optionally filtered by a WHERE clause."""
    app.store.flush()
    return app.store.query(f"SELECT * FROM request {where} ORDER BY rowid", params)


async def rows_of(app, n: int) -> list[dict]:
    """All request rows once n requests have been settled (the access line follows the row);
    fails if more than n were."""
    await wait_for(lambda: len(app.log.of("access")) >= n)
    assert len(app.log.of("access")) == n
    return rows(app)


async def one_row(app, rid: str) -> dict:
    """The request's row, once it is settled; fails if there is not exactly one."""
    await wait_for(lambda: rows(app, "WHERE request_id = ?", (rid,)), timeout=5, step=0.02)
    got = rows(app, "WHERE request_id = ?", (rid,))
    assert len(got) == 1
    assert list(got[0]) == list(COLUMNS)
    return got[0]


def rid_header(rid: str) -> dict:
    return {"X-Request-Id": rid}


# ---- what the relay answers -------------------------------------------------------------------
def error_of(resp) -> dict:
    """The `error` object of one of the relay's own JSON error bodies (its shape checked)."""
    assert resp.header("content-type") == "application/json"
    body = resp.json()
    assert list(body) == ["error"]
    assert list(body["error"]) == ["message", "type", "code", "param", "details"]
    assert body["error"]["param"] is None
    return body["error"]


async def slots_metrics(app) -> dict:
    resp = await httpc.fetch(app.port, "GET", "/api/slots/metrics")
    assert resp.status == 200
    return resp.json()


def contents(resp) -> list:
    """The `content` of every streamed delta that has one, in order (None kept)."""
    return [
        e["choices"][0]["delta"].get("content")
        for e in resp.data_events()
        if isinstance(e, dict)
        and e.get("choices")
        and "content" in e["choices"][0].get("delta", {})
    ]
