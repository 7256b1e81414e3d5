"""Pools over real sockets (issue 32): several simulators list one model, the relay balances
them and keeps each conversation on the member that served its first turn, in every API's
shape; a down member is passed by, a failing one passes the request on, the pool has one queue,
`/metrics` counts it all, and a reload adds and removes members while requests are served.

Where a request landed is read from the simulators' own request logs (the relay passes the
`X-Request-Id` upstream) and from its row. What a follow-up turn reuses is what the
simulator's prompt cache reports (relay/sim/slots.py, as llama-server does); the pool's sums
of reuse come from scripted members answering the usage each request names.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay.config import BalanceConfig, UpstreamConfig
from relay.observe.metrics import UpstreamState
from relay.policy.affinity import want_of
from relay.policy.prefix import fingerprint
from relay.sim.server import Simulator
from relay.stream.dialect import Api
from tests.stream.test_untrusted_usage import SSE_HEAD, chunk, data
from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import contents, error_of, rows, wait_for
from tests.support.pools import HOLD, MODEL, Conversation, Held, hold, landed, members

pytestmark = pytest.mark.timeout(120)
CHAT = "/v1/chat/completions"
APIS = ["chat", "messages", "responses", "completions", "native"]
# A generous deadline for what the relay is waited for, on a busy machine.
WAIT_S = 30.0
DOWN = UpstreamState.DOWN


class Sims(dict):
    """The pool's simulators by member name (m0, m1, ...); every one started is stopped at
    the end, one restarted too."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[Simulator] = []

    async def start(self, n: int) -> Sims:
        for i in range(n):
            await self.restart(f"m{i}")
        return self

    async def restart(self, name: str, port: int = 0) -> Simulator:
        """`name`'s simulator (again, on `port`)."""
        s = self[name] = Simulator(port=port)
        self.started.append(s)
        await s.start()
        return s


@pytest.fixture
async def sims():
    out = Sims()
    yield out
    for s in out.started:
        await s.stop()


@pytest.fixture
def helds():
    """Streams the test holds, closed at the end whatever happened."""
    out: list[Held] = []
    yield out
    for h in out:
        h.close()


async def idle(app, *names: str) -> None:
    """Every slot of these members (all, when none is named) is back: what their requests
    taught the pool is learnt (the table learns at release)."""
    ups = [app.upstreams[n] for n in names] if names else list(app.upstreams.values())
    await wait_for(lambda: all(up.slots.in_flight == 0 for up in ups), timeout=WAIT_S)


async def held_on(app, sims, helds, conv: Conversation, rid: str) -> str:
    """`conv`'s turn held as a stream; the one member whose simulator got it."""
    helds.append(await hold(app.port, conv, rid))
    [member] = landed(sims, rid)
    return member


def row_of(app, rid: str) -> dict:
    [row] = rows(app, "WHERE request_id = ?", (rid,))
    return row


async def settled_row(app, rid: str) -> dict:
    await wait_for(lambda: rows(app, "WHERE request_id = ?", (rid,)), timeout=WAIT_S)
    return row_of(app, rid)


def metric(text: str, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} {labels}")


async def metrics(app) -> str:
    resp = await httpc.fetch(app.port, "GET", "/metrics")
    assert resp.status == 200
    return resp.body.decode()


async def pool_waiting(app, want: int) -> str:
    """/metrics once the pool's queue holds `want` requests."""
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while True:
        text = await metrics(app)
        if metric(text, "relay_pool_queue_waiting", pool=MODEL) == want:
            return text
        assert loop.time() < end, f"the pool's queue never held {want}"
        await asyncio.sleep(0.02)


# ---- affinity: each conversation stays on its member, in every API's shape ----------------------
@pytest.mark.parametrize("api", APIS)
async def test_each_conversation_keeps_the_member_of_its_first_turn(make_relay, sims, helds, api):
    await sims.start(2)
    app = await make_relay(upstreams=members(*(s.url for s in sims.values()), parallel=2))
    convs = {n: Conversation(api, f"{api}-{n}") for n in ("p", "q", "r", "s")}
    home: dict[str, str] = {}
    # First turns held at once: a new conversation goes to the least loaded member, so each
    # pair of them lands on both members.
    for n, conv in convs.items():
        home[n] = await held_on(app, sims, helds, conv, f"{n}1")
    assert home["p"] != home["q"] and home["r"] != home["s"]
    assert sorted(Counter(home.values()).values()) == [2, 2]
    for h in helds:
        h.close()
    await idle(app)
    on = {m: [n for n in convs if home[n] == m] for m in sims}
    (x, (p, q)), (y, (r, s)) = on.items()
    for conv in convs.values():
        conv.follow()
    # P's second turn on X; Q's follows it there, although Y is idle: its prefix is on X
    # (and X holds 2, within the bound ceil(1.25 x 2 / 2)).
    assert await held_on(app, sims, helds, convs[p], f"{p}2") == x
    assert await held_on(app, sims, helds, convs[q], f"{q}2") == x
    assert await held_on(app, sims, helds, convs[r], f"{r}2") == y
    for h in helds[-3:-1]:
        h.close()
    await idle(app, x)
    # Y holds R's turn, X nothing: S's turn goes home to Y all the same.
    assert await held_on(app, sims, helds, convs[s], f"{s}2") == y
    for h in helds:
        h.close()
    await idle(app)
    # A third turn, whole this time, lands home too; the rows say so.
    for n, conv in convs.items():
        conv.follow()
        resp = await httpc.fetch(
            app.port, "POST", conv.path, conv.body(tokens=3), {"X-Request-Id": f"{n}3"}
        )
        assert resp.status == 200 and resp.complete
        assert landed(sims, f"{n}3") == [home[n]]
    await idle(app)
    for n in convs:
        for turn in (1, 2, 3):
            row = await settled_row(app, f"{n}{turn}")
            assert (row["upstream_served"], row["pool"], row["fallback_attempts"]) == (
                home[n],
                MODEL,
                0,
            )
            assert row["path"] == convs[n].path


def timings_of(resp) -> dict:
    """The `timings` of a chat stream's last event that has them (llama-server's, and the
    simulator's prompt cache's)."""
    found = [e["timings"] for e in resp.data_events() if isinstance(e, dict) and "timings" in e]
    assert found
    return found[-1]


@pytest.mark.parametrize("affinity", [True, False], ids=["affinity", "least_loaded"])
async def test_a_follow_up_reads_only_what_is_new_where_its_prompt_is_cached(
    make_relay, sims, helds, affinity
):
    await sims.start(2)
    app = await make_relay(
        upstreams=members(*(s.url for s in sims.values()), parallel=2),
        balance=BalanceConfig(affinity=affinity),
    )
    conv = Conversation("chat", "reuse")
    resp = await httpc.fetch(app.port, "POST", CHAT, conv.body(tokens=6), {"X-Request-Id": "u1"})
    assert resp.status == 200 and resp.complete
    [x] = landed(sims, "u1")
    [y] = [m for m in sims if m != x]
    first = timings_of(resp)
    assert first["cache_n"] == 0
    read = first["prompt_n"]
    # Another agent's conversation streams on X (its own system prompt: the simulator gives
    # it the free slot, as llama-server would), Y is idle.
    other = "Review the diff and list its risks."
    for i in range(2):
        rid = f"other{i}"
        on = await held_on(app, sims, helds, Conversation("chat", rid, system=other), rid)
        if on == x:
            break
        # On Y (the pool was idle: rendezvous chose): let go, and the next goes to X.
        helds[-1].close()
        await idle(app, y)
    assert on == x
    conv.follow("".join(c for c in contents(resp) if c))
    resp = await httpc.fetch(app.port, "POST", CHAT, conv.body(tokens=3), {"X-Request-Id": "u2"})
    assert resp.status == 200 and resp.complete
    second = timings_of(resp)
    row = await settled_row(app, "u2")
    assert (row["cached_tokens"], row["prompt_tokens"]) == (
        second["cache_n"],
        second["cache_n"] + second["prompt_n"],
    )
    if affinity:
        # Home, though busier: the member reads only what is new.
        assert landed(sims, "u2") == [x]
        assert second["cache_n"] >= read
    else:
        # The least loaded, which reads it all.
        assert landed(sims, "u2") == [y]
        assert second["cache_n"] == 0
    print(f"affinity {affinity}: first turn read {read}; second turn {second}")


async def test_the_hold_for_home_is_learnt_from_the_members_answers(make_relay, sims, helds):
    """`home_wait_s = "auto"` over real sockets: a served turn's `timings` (the simulator
    told to read 2 ms a token) teach the pool's pace, and its prompt's length the hold of
    the next turn: twice the re-read, 2 x prompt tokens x 2 ms."""
    await sims.start(2)
    app = await make_relay(
        upstreams=members(*(s.url for s in sims.values()), parallel=1),
        balance=BalanceConfig(affinity_wait_s=0.05),
        pool_timeout_s=60,
    )
    # A system prompt long enough that its prefill outweighs fixed costs (`PACE_MIN_TOKENS`).
    conv = Conversation("chat", "paced", system="Review each change for its risks. " * 12)
    resp = await httpc.fetch(
        app.port,
        "POST",
        CHAT,
        conv.body(tokens=2, prefill_ms_per_token=2.0),
        {"X-Request-Id": "p1"},
    )
    assert resp.status == 200 and resp.complete
    await idle(app)
    read = timings_of(resp)
    row = await settled_row(app, "p1")
    assert read["cache_n"] == 0 and row["prompt_tokens"] == read["prompt_n"] > 64
    assert app.board.paces[MODEL].per_token == pytest.approx(0.002)
    [home] = landed(sims, "p1")
    [other] = [m for m in sims if m != home]
    conv.follow("".join(c for c in contents(resp) if c))
    # Its next turn holds its home's one slot; the other member is free. A turn after it
    # would hold for its home 2 x prompt_n x 2 ms.
    assert await held_on(app, sims, helds, conv, "p2") == home
    ups = [app.upstreams[m].slots for m in sorted(sims)]
    want = want_of(Api.CHAT, json.dumps(conv.body()).encode())
    until = app.board.hold_until(ups, want, 100.0, 60.0, MODEL)
    assert until == pytest.approx(100.0 + 2 * read["prompt_n"] * 0.002)
    assert app.upstreams[other].slots.in_flight == 0


async def test_v1_models_lists_the_pooled_model_once(make_relay, sims):
    await sims.start(3)
    ups = members(*(s.url for s in sims.values()))
    ups.append(UpstreamConfig(name="solo", url=sims["m0"].url, models=["other"]))
    app = await make_relay(upstreams=ups)
    resp = await httpc.fetch(app.port, "GET", "/v1/models")
    assert resp.status == 200
    assert [m["id"] for m in resp.json()["data"]] == [MODEL, "other"]


# ---- a member down, and back ----------------------------------------------------------------------
async def test_a_down_member_is_passed_by_and_used_again_once_back(make_relay, sims, helds):
    await sims.start(3)
    app = await make_relay(
        upstreams=members(*(s.url for s in sims.values()), parallel=4),
        health_interval_s=0.05,
        down_probe_interval_s=0.05,
    )
    port = sims["m1"].port
    await sims["m1"].stop()
    await wait_for(lambda: app.upstreams["m1"].health.probe is DOWN, timeout=WAIT_S)
    # Two new conversations held at once: one on each member left.
    first = [
        await held_on(app, sims, helds, Conversation("chat", f"down-{i}"), f"d{i}") for i in (0, 1)
    ]
    assert sorted(first) == ["m0", "m2"]
    # m1 holds nothing: were it not passed by it would be the least loaded, every time.
    served = []
    for i in range(2, 8):
        conv = Conversation("chat", f"down-{i}")
        resp = await httpc.fetch(
            app.port, "POST", conv.path, conv.body(tokens=2), {"X-Request-Id": f"d{i}"}
        )
        assert resp.status == 200 and resp.complete
        served += landed(sims, f"d{i}")
    assert len(served) == 6 and set(served) <= {"m0", "m2"}
    # Nothing tried m1: no request fell back, and none was sent there.
    assert app.log.of("fallback") == []
    for i in range(2, 8):
        row = await settled_row(app, f"d{i}")
        assert (row["upstream_requested"], row["fallback_attempts"]) == (row["upstream_served"], 0)
        assert row["upstream_served"] in ("m0", "m2")
    # Back on its port: once the probe sees it, the idle member takes the next conversation.
    await sims.restart("m1", port)
    await wait_for(lambda: app.upstreams["m1"].health.probe is not DOWN, timeout=WAIT_S)
    assert await held_on(app, sims, helds, Conversation("chat", "back"), "back") == "m1"
    assert [r.path for r in sims["m1"].requests if r.method == "POST"] == [CHAT]


# ---- a member that fails, every member failing, a 4xx --------------------------------------------
def failing(status: int):
    """A scripted member that answers every request `status`."""
    body = json.dumps({"error": {"code": status, "message": "boom", "type": "server_error"}})

    async def script(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 %d Internal Server Error\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body.encode())
            )
            await writer.drain()

    return script


def rids_of(up: Scripted) -> list[str]:
    out = []
    for head in up.heads:
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.lower() == b"x-request-id":
                out.append(value.strip().decode())
    return out


async def test_a_member_answering_500_passes_the_request_to_the_next(make_relay, sims, helds):
    await sims.restart("m1")
    bad = await Scripted(failing(500)).start()
    try:
        ups = members(bad.url, sims["m1"].url, parallel=2)
        app = await make_relay(upstreams=ups)
        # A stream held on the good member (tried on the bad one first or not).
        helds.append(await hold(app.port, Conversation("chat", "holder"), "holder"))
        assert landed(sims, "holder") == ["m1"]
        # The bad member is now the least loaded: the next conversation goes there first.
        conv = Conversation("chat", "next")
        resp = await httpc.fetch(
            app.port, "POST", conv.path, conv.body(tokens=4), {"X-Request-Id": "next"}
        )
        assert resp.status == 200 and resp.complete
        assert "next" in rids_of(bad)
        assert landed(sims, "next") == ["m1"]
        [fb] = [f for f in app.log.of("fallback") if f["request_id"] == "next"]
        assert (fb["upstream"], fb["next"], fb["reason"]) == ("m0", MODEL, "upstream_unavailable")
        row = await settled_row(app, "next")
        assert (
            row["upstream_requested"],
            row["upstream_served"],
            row["fallback_attempts"],
            row["pool"],
            row["status"],
        ) == ("m0", "m1", 1, MODEL, 200)
    finally:
        await bad.stop()


async def test_every_member_failing_leaves_the_request_to_the_fallback(make_relay, sims):
    await sims.start(1)
    bad = [await Scripted(failing(500)).start() for _ in range(2)]
    try:
        ups = members(bad[0].url, bad[1].url, parallel=2)
        ups[0].fallback = ["spare"]
        ups.append(UpstreamConfig(name="spare", url=sims["m0"].url, models=["spare"]))
        app = await make_relay(upstreams=ups)
        conv = Conversation("chat", "doomed")
        resp = await httpc.fetch(
            app.port, "POST", conv.path, conv.body(tokens=4), {"X-Request-Id": "doomed"}
        )
        assert resp.status == 200 and resp.complete
        assert "".join(c for c in contents(resp) if c) == httpc.sim_text(4)
        # Each member was tried once, then the fallback.
        assert [rids_of(b) for b in bad] == [["doomed"], ["doomed"]]
        fbs = [(f["upstream"], f["next"]) for f in app.log.of("fallback")]
        assert len(fbs) == 2 and fbs[0][1] == MODEL and fbs[1][1] == "spare"
        assert {fbs[0][0], fbs[1][0]} == {"m0", "m1"}
        row = await settled_row(app, "doomed")
        assert (
            row["upstream_requested"],
            row["upstream_served"],
            row["fallback_attempts"],
            row["pool"],
        ) == (fbs[0][0], "spare", 2, "spare")
    finally:
        for b in bad:
            await b.stop()


async def test_a_members_400_passes_through(make_relay, sims):
    await sims.start(2)
    app = await make_relay(upstreams=members(*(s.url for s in sims.values())))
    conv = Conversation("chat", "bad-request")
    resp = await httpc.fetch(
        app.port, "POST", conv.path, conv.body(status=400), {"X-Request-Id": "four"}
    )
    assert resp.status == 400
    assert len(landed(sims, "four")) == 1
    assert sum(len(s.requests) for s in sims.values()) == 1
    assert app.log.of("fallback") == []
    row = await settled_row(app, "four")
    assert (row["status"], row["fallback_attempts"], row["pool"]) == (400, 0, MODEL)


# ---- the pool's one queue -----------------------------------------------------------------------
async def test_the_pool_has_one_queue_served_oldest_first(make_relay, sims, helds):
    await sims.start(2)
    app = await make_relay(
        upstreams=members(*(s.url for s in sims.values()), parallel=1, queue=1),
        pool_timeout_s=60,
        heartbeat_s=0,
    )
    # One held on each member: the pool is full.
    a = await held_on(app, sims, helds, Conversation("chat", "qa"), "qa")
    b = await held_on(app, sims, helds, Conversation("chat", "qb"), "qb")
    assert {a, b} == {"m0", "m1"}
    holder = {a: helds[0], b: helds[1]}
    # Two wait in the pool's one queue (its members' queue summed), the oldest first.
    waiters = []
    for i in (1, 2):
        w = Held(app.port, CHAT, Conversation("chat", f"w{i}").body(**HOLD), f"w{i}")
        helds.append(w)
        waiters.append(asyncio.create_task(w.start(timeout=WAIT_S)))
        await pool_waiting(app, i)
    # The fifth: the queue is full.
    conv = Conversation("chat", "fifth")
    resp = await httpc.fetch(app.port, "POST", conv.path, conv.body(tokens=2))
    assert resp.status == 503
    assert error_of(resp)["code"] == "upstream_busy"
    assert int(resp.header("retry-after")) >= 1
    # The second member's slot frees first: the oldest waiter takes it, the other waits on.
    holder[b].close()
    await waiters[0]
    assert landed(sims, "w1") == [b]
    assert landed(sims, "w2") == []
    await pool_waiting(app, 1)
    holder[a].close()
    await waiters[1]
    assert landed(sims, "w2") == [a]
    await pool_waiting(app, 0)


# ---- /metrics ----------------------------------------------------------------------------------
class Member:
    """A scripted member: each request's stream carries the usage its "sim" object names
    (`usage`: [prompt, cached]); with `hold` its end waits until the test releases it."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.rids: list[str] = []

    def gate(self, rid: str) -> asyncio.Event:
        return self.gates.setdefault(rid, asyncio.Event())

    async def script(self, up, index, reader, writer) -> None:
        while (head := await up.read_request(reader)) is not None:
            body = json.loads(up.bodies[-1])
            rid = next(
                line.split(b":", 1)[1].strip().decode()
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"x-request-id:")
            )
            self.rids.append(rid)
            prompt, cached = body["sim"]["usage"]
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": 1,
                "total_tokens": prompt + 1,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            delta = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}}]}
            delta["choices"][0]["delta"] = {"role": "assistant", "content": "ok"}
            writer.write(SSE_HEAD + chunk(data(delta)))
            await writer.drain()
            if body["sim"].get("hold"):
                await self.gate(rid).wait()
            end = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
            writer.write(chunk(data(end)) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()


async def test_metrics_count_the_pool(make_relay, helds):
    scripted = {f"m{i}": Member() for i in range(2)}
    ups = {n: await Scripted(m.script).start() for n, m in scripted.items()}
    try:
        cfg = members(*(u.url for u in ups.values()), parallel=1, queue=2)
        # A freed slot goes to the request whose conversation lives there however long the
        # other waited (the bound is another test's).
        balance = BalanceConfig(affinity_wait_s=60)
        app = await make_relay(upstreams=cfg, pool_timeout_s=60, heartbeat_s=0, balance=balance)
        convs = {n: Conversation("chat", f"metrics-{n}") for n in ("a", "b", "c")}
        sent: list[tuple[str, int, int]] = []

        def where(rid: str) -> str:
            [name] = [n for n, m in scripted.items() if rid in m.rids]
            return name

        def body(n: str, rid: str, prompt: int, cached: int, held: bool) -> dict:
            sent.append((rid, prompt, cached))
            return convs[n].body(usage=[prompt, cached], hold=held)

        async def served(n: str, rid: str, prompt: int, cached: int) -> None:
            resp = await httpc.fetch(
                app.port, "POST", CHAT, body(n, rid, prompt, cached, False), {"X-Request-Id": rid}
            )
            assert resp.status == 200 and resp.complete

        def started(n: str, rid: str, prompt: int, cached: int) -> asyncio.Task:
            """A request whose stream waits for `release` once its member has it."""
            h = Held(app.port, CHAT, body(n, rid, prompt, cached, True), rid)
            helds.append(h)
            return asyncio.create_task(h.start(timeout=WAIT_S))

        def release(rid: str) -> None:
            scripted[where(rid)].gate(rid).set()

        # Two new conversations at once: one on each member.
        await started("a", "a1", 1000, 0)
        await started("b", "b1", 800, 0)
        x, y = where("a1"), where("b1")
        assert {x, y} == {"m0", "m1"}
        release("a1")
        release("b1")
        await idle(app)
        # Their second turns, home; B's member says it reused nothing: a miss.
        convs["a"].follow()
        convs["b"].follow()
        await served("a", "a2", 1500, 1000)
        await served("b", "b2", 1200, 0)
        assert (where("a2"), where("b2")) == (x, y)
        # Third turns held, one on each member; then C (new) and A's fourth wait, in that
        # order.
        convs["a"].follow()
        convs["b"].follow()
        await started("a", "a3", 2000, 1500)
        await started("b", "b3", 1600, 1200)
        assert (where("a3"), where("b3")) == (x, y)
        c1 = started("c", "c1", 500, 0)
        await pool_waiting(app, 1)
        convs["a"].follow()
        a4 = started("a", "a4", 2400, 2000)
        text = await pool_waiting(app, 2)
        assert metric(text, "relay_slots_in_flight", upstream=x) == 1
        assert metric(text, "relay_slots_in_flight", upstream=y) == 1
        # A's fourth waits for X, where A lives; C for any member, counted on the one with
        # the most room left in its queue when it came (both alike: the first, m0). The
        # members' counts sum to the pool's queue.
        assert metric(text, "relay_queue_waiting", upstream=x) == 1 + (x == "m0")
        assert metric(text, "relay_queue_waiting", upstream=y) == int(y == "m0")
        assert metric(text, "relay_pool_queue_waiting", pool=MODEL) == 2
        for m in ("m0", "m1"):
            assert metric(text, "relay_pool_member", pool=MODEL, upstream=m) == 1
        # X's slot frees: A's fourth takes it before C, the older, whose turn comes with Y's.
        release("a3")
        await a4
        assert where("a4") == x
        assert not c1.done()
        release("b3")
        await c1
        assert where("c1") == y
        release("a4")
        release("c1")
        await idle(app)
        await wait_for(lambda: len(rows(app)) == len(sent), timeout=WAIT_S)
        text = await metrics(app)
        prompt = sum(p for _, p, _ in sent)
        cached = sum(c for _, _, c in sent)
        assert metric(text, "relay_pool_prompt_tokens_total", pool=MODEL) == prompt == 11000
        assert metric(text, "relay_pool_cached_tokens_total", pool=MODEL) == cached == 5700
        assert metric(text, "relay_pool_cache_hit_ratio", pool=MODEL) == pytest.approx(
            cached / prompt
        )
        # New: a1, b1. Home: a2, b2, a3, b3, and a4 given its home's freed slot. Waited: c1,
        # given the slot of a member its conversation does not live on.
        routed = {
            why: metric(text, "relay_pool_routed_total", pool=MODEL, reason=why)
            for why in ("new", "affinity", "waited")
        }
        assert routed == {"new": 2, "affinity": 5, "waited": 1}
        assert metric(text, "relay_pool_cache_misses_total", pool=MODEL) == 1
        assert metric(text, "relay_pool_queue_waiting", pool=MODEL) == 0
        for rid, p, c in sent:
            row = row_of(app, rid)
            assert (row["prompt_tokens"], row["cached_tokens"], row["pool"]) == (p, c, MODEL)
            assert row["upstream_served"] == where(rid)
    finally:
        for u in ups.values():
            await u.stop()


# ---- a reload adds a member, and removes one ---------------------------------------------------
async def test_a_reload_adds_a_member_and_removes_one(make_relay, sims, helds):
    await sims.start(3)
    urls = {n: s.url for n, s in sims.items()}
    app = await make_relay(upstreams=members(urls["m0"], urls["m1"], parallel=2))
    convs = [Conversation("chat", f"reload{i}") for i in range(3)]
    got = [await held_on(app, sims, helds, convs[0], "reload0")]
    summary = app.reload(msgspec.structs.replace(app.config, upstream=members(*urls.values())))
    assert summary["added"] == ["m2"]
    # The stream held across the reload goes on; three conversations at once: one on each
    # member, the new one included.
    before = len(helds[0].received)
    await wait_for(lambda: len(helds[0].received) > before + 1000, timeout=WAIT_S)
    got += [await held_on(app, sims, helds, convs[i], f"reload{i}") for i in (1, 2)]
    assert sorted(got) == ["m0", "m1", "m2"]
    on_m1 = helds[got.index("m1")]
    for h in helds:
        if h is not on_m1:
            h.close()
    await idle(app, "m0", "m2")
    # m1 removed while a stream is on it: that stream goes on; no request goes there any more.
    cfg = [u for u in members(*urls.values()) if u.name != "m1"]
    summary = app.reload(msgspec.structs.replace(app.config, upstream=cfg))
    assert summary["removed"] == ["m1"]
    before = len(on_m1.received)
    await wait_for(lambda: len(on_m1.received) > before + 1000, timeout=WAIT_S)
    seen = len(sims["m1"].requests)
    # The conversation that lived on m1 goes on elsewhere, and new ones too.
    moved = convs[got.index("m1")].follow()
    later = [moved] + [Conversation("chat", f"after{i}") for i in range(8)]
    for i, conv in enumerate(later):
        resp = await httpc.fetch(
            app.port, "POST", conv.path, conv.body(tokens=2), {"X-Request-Id": f"after{i}"}
        )
        assert resp.status == 200 and resp.complete
        assert landed(sims, f"after{i}")[0] in ("m0", "m2")
        row = await settled_row(app, f"after{i}")
        assert (row["upstream_served"], row["fallback_attempts"]) == (
            landed(sims, f"after{i}")[0],
            0,
        )
    assert len(sims["m1"].requests) == seen
    on_m1.close()


# ---- a member killed mid-conversation -----------------------------------------------------------
def dechunk(raw: bytes) -> tuple[list[bytes], bool]:
    """The payloads of the whole chunks of a chunked body, and whether its terminating chunk
    came; fails on a chunk cut short."""
    out: list[bytes] = []
    pos = 0
    while pos < len(raw):
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol], 16)
        if size == 0:
            assert raw[eol:] == b"\r\n\r\n", raw[eol:]
            return out, True
        payload = raw[eol + 2 : eol + 2 + size]
        assert raw[eol + 2 + size : eol + 4 + size] == b"\r\n", "a chunk cut short"
        out.append(payload)
        pos = eol + 4 + size
    return out, False


@pytest.mark.parametrize("probing", [True, False], ids=["probed", "unprobed"])
async def test_a_member_killed_mid_conversation(make_relay, sims, helds, probing):
    await sims.start(3)
    probes = {"health_interval_s": 0.05, "down_probe_interval_s": 0.05} if probing else {}
    app = await make_relay(upstreams=members(*(s.url for s in sims.values())), **probes)
    conv = Conversation("chat", "killed")
    resp = await httpc.fetch(app.port, "POST", CHAT, conv.body(tokens=3), {"X-Request-Id": "k1"})
    assert resp.status == 200 and resp.complete
    [x] = landed(sims, "k1")
    # Its second turn streams from X; X dies once content reached the client.
    conv.follow(httpc.sim_text(3))
    stream = Held(app.port, CHAT, conv.body(tokens=2000, interval_ms=20), "k2")
    helds.append(await stream.start())
    await wait_for(lambda: stream.received.count(b'"content":"') >= 3, timeout=WAIT_S)
    port = sims[x].port
    await sims[x].stop()
    raw = await stream.ended(WAIT_S)
    # The client's stream ends without its terminating chunk, after whole events.
    assert stream.head is not None and stream.head.status == 200
    assert stream.head.header("transfer-encoding") == "chunked"
    payloads, terminated = dechunk(raw)
    assert not terminated
    body = b"".join(payloads)
    assert body.endswith(b"\n\n")
    events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    said = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    said = [c for c in said if c]
    assert len(said) >= 3 and "".join(said) == httpc.sim_text(len(said))
    row = await settled_row(app, "k2")
    assert (
        row["upstream_served"],
        row["pool"],
        row["status"],
        row["ok"],
        row["error_code"],
        row["completion_tokens"],
    ) == (x, MODEL, 200, 0, "upstream_dropped", len(said))
    if probing:
        await wait_for(lambda: app.upstreams[x].health.probe is DOWN, timeout=WAIT_S)
    # The third turn goes to another member, and is served.
    conv.follow("".join(said))
    resp = await httpc.fetch(app.port, "POST", CHAT, conv.body(tokens=3), {"X-Request-Id": "k3"})
    assert resp.status == 200 and resp.complete
    [y] = landed(sims, "k3")
    assert y != x
    row = await settled_row(app, "k3")
    fell = [(f["upstream"], f["next"]) for f in app.log.of("fallback")]
    if probing:
        # Passed by: the probe saw it down.
        assert (row["upstream_requested"], row["fallback_attempts"], fell) == (y, 0, [])
    else:
        # Tried first (its home), refused, and the pool's next member took it.
        assert (row["upstream_requested"], row["fallback_attempts"], fell) == (x, 1, [(x, MODEL)])
    assert row["upstream_served"] == y
    # The table no longer names X for it: its home is Y now.
    await idle(app)
    fp = fingerprint(Api.CHAT, conv.body())
    assert app.board.table.longest_holder(fp, [x]) is None
    assert app.board.table.longest_holder(fp, list(sims)) == (y, len(fp))
    # X restarted on its port serves new conversations again: three at once, one each.
    await sims.restart(x, port)
    if probing:
        await wait_for(lambda: app.upstreams[x].health.probe is not DOWN, timeout=WAIT_S)
    got = [
        await held_on(app, sims, helds, Conversation("chat", f"again{i}"), f"again{i}")
        for i in range(3)
    ]
    assert sorted(got) == ["m0", "m1", "m2"]
