"""`GET /health` over sockets, as a load balancer asks it: answered by the relay from its
upstreams' health, with no key, never charged, never forwarded, never a row; 503 with the
reason when no upstream can serve. The operator's view of each upstream (`/api/upstreams`) is
an admin endpoint. The log tells each change of an upstream's state once (issue 34, items 1
and 7)."""

import asyncio
import json
import time

from relay.app import App
from relay.config import Config, DispatcherConfig, ServerConfig, StoreConfig, UpstreamConfig
from relay.observe.log import Log
from relay.sim.server import Simulator
from tests.support import httpc
from tests.support.helpers import closed_port, release, rows, wait_for
from tests.support.keys import ADMIN, bearer, key, sha

CHAT = "/v1/chat/completions"
OK = b'{"status":"ok"}'
LLAMA_JSON = "application/json; charset=utf-8"


class JsonLog(Log):
    """The relay's log as it writes it: JSON lines, read back."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        super().__init__(sink=self.written.append)

    def events(self, event: str) -> list[dict]:
        self.flush()
        lines = b"".join(self.written).splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == event]


async def relay(urls: list[str], log: Log | None = None, host="127.0.0.1", keys=(), **disp) -> App:
    """A relay in front of `urls` (upstreams a, b, ...: each a fallback of the one before)."""
    names = [chr(ord("a") + i) for i in range(len(urls))]
    ups = [
        UpstreamConfig(name=n, url=u, parallel=4, fallback=names[i + 1 :])
        for i, (n, u) in enumerate(zip(names, urls))
    ]
    cfg = Config(
        server=ServerConfig(host=host, port=0),
        dispatcher=DispatcherConfig(**{"health_interval_s": 0, **disp}),
        upstream=ups,
        key=list(keys),
        store=StoreConfig(path=":memory:"),
        admin_key_sha256=sha(ADMIN) if keys else None,
    )
    app = App(cfg, log or JsonLog())
    await app.start()
    return app


async def health(port: int, path: str = "/health", headers=None, method: str = "GET"):
    return await httpc.fetch(port, method, path, headers=headers)


async def key_figures(port: int) -> list[str]:
    """The `/metrics` lines of key alpha."""
    text = (await httpc.fetch(port, "GET", "/metrics", headers=bearer(ADMIN))).body.decode()
    return [line for line in text.splitlines() if 'key="alpha"' in line]


def probes_of(sim) -> int:
    return len([r for r in sim.requests if r.path == "/health"])


async def test_health_needs_no_key_never_forwarded_and_leaves_no_row(sim):
    app = await relay([sim.url], keys=[key()])
    try:
        for path in ("/health", "/v1/health"):
            for headers in (None, bearer(), bearer("sk-wrong")):  # a key sent anyway: ignored
                resp = await health(app.port, path, headers)
                assert (resp.status, resp.body) == (200, OK), (path, headers)
                assert resp.header("content-type") == LLAMA_JSON
        assert probes_of(sim) == 0  # answered by the relay itself
        # judged on the head alone too: a body sent with it is read, not refused with a 401
        resp = await httpc.fetch(app.port, "GET", "/health", b"{}", bearer("sk-wrong"))
        assert (resp.status, resp.body) == (200, OK)
        # HEAD: the head alone, and the connection goes on
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        try:
            head = await httpc.exchange(reader, writer, "HEAD", "/health")
            assert head.status == 200 and head.header("content-length") == str(len(OK))
            again = await httpc.exchange(reader, writer, "GET", "/health")
            assert (again.status, again.body) == (200, OK)
        finally:
            writer.close()
        # other routes still ask for a key
        assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2))).status == 401
        assert (await httpc.fetch(app.port, "GET", "/props")).status == 401
        # no row and no access line for the probes: the 401s above are the only ones
        await wait_for(lambda: len(rows(app)) == 2)
        assert [r["path"] for r in rows(app)] == [CHAT, "/props"]
        assert len(app.log.events("access")) == 2
    finally:
        await app.stop(drain_timeout_s=0.5)


async def test_a_spent_key_probes_health_uncharged_and_never_429(sim):
    app = await relay([sim.url], keys=[key("alpha", requests_per_day=1)])
    try:
        assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), bearer())).status == 200
        spent = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), bearer())
        assert spent.status == 429
        before = app.budgets.usage("alpha", time.time())
        figures = await key_figures(app.port)
        for _ in range(5):
            resp = await health(app.port, headers=bearer())
            assert (resp.status, resp.body) == (200, OK)
        assert app.budgets.usage("alpha", time.time()) == before
        assert await key_figures(app.port) == figures and figures
        assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), bearer())).status == 429
    finally:
        await app.stop(drain_timeout_s=0.5)


async def test_every_upstream_down_is_a_503_with_the_reason():
    app = await relay(
        [f"http://127.0.0.1:{closed_port()}", f"http://127.0.0.1:{closed_port()}"],
        health_interval_s=5.0,
    )
    try:
        await wait_for(lambda: all(up.health.probe == "down" for up in app.upstreams.values()))
        for method in ("GET", "HEAD"):
            resp = await health(app.port, method=method)
            assert resp.status == 503 and resp.header("content-type") == LLAMA_JSON
        resp = await health(app.port, "/v1/health")
        assert resp.json() == {
            "error": {
                "message": "no upstream is reachable",
                "type": "unavailable_error",
                "code": 503,
            }
        }
    finally:
        await app.stop(drain_timeout_s=0.5)


async def test_an_upstream_loading_its_model_is_llama_servers_own_503(sim):
    sim.loading = True
    app = await relay([sim.url], health_interval_s=0.05)
    try:
        await wait_for(lambda: app.upstreams["a"].health.probe == "loading")
        relayed = await health(app.port)
        direct = await health(sim.port)  # what llama-server (as simulated) says itself
        assert relayed.status == direct.status == 503
        assert relayed.body == direct.body and relayed.json()["error"]["message"] == "Loading model"
        assert relayed.header("content-type") == direct.header("content-type") == LLAMA_JSON
        sim.loading = False
        await wait_for(lambda: app.upstreams["a"].health.probe == "ready")
        assert (await health(app.port)).body == OK
    finally:
        await app.stop(drain_timeout_s=0.5)


async def test_one_upstream_that_can_serve_is_enough(sim):
    app = await relay([f"http://127.0.0.1:{closed_port()}", sim.url], health_interval_s=5.0)
    try:
        await wait_for(lambda: app.upstreams["b"].health.probe == "ready")
        await wait_for(lambda: app.upstreams["a"].health.probe == "down")
        assert (await health(app.port)).body == OK
    finally:
        await app.stop(drain_timeout_s=0.5)


async def test_without_probes_health_follows_what_requests_found():
    port = closed_port()
    app = await relay([f"http://127.0.0.1:{port}"])
    try:
        assert (await health(app.port)).status == 200  # not seen, not down
        assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2))).status == 502
        resp = await health(app.port)
        assert resp.status == 503 and resp.json()["error"]["message"] == "no upstream is reachable"
        sim = Simulator(port=release(port))
        await sim.start()
        try:
            assert (await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2))).status == 200
            assert (await health(app.port)).body == OK
        finally:
            await sim.stop()
    finally:
        await app.stop(drain_timeout_s=0.5)


async def test_the_readiness_view_is_for_the_admin(sim):
    down = closed_port()
    app = await relay(
        [sim.url + "/", f"http://127.0.0.1:{down}"], keys=[key()], health_interval_s=5.0
    )
    try:
        await wait_for(lambda: app.upstreams["b"].health.probe == "down")
        await wait_for(lambda: app.upstreams["a"].health.probe == "ready")
        assert (await httpc.fetch(app.port, "GET", "/api/upstreams")).status == 401
        assert (
            await httpc.fetch(app.port, "GET", "/api/upstreams", headers=bearer())
        ).status == 401
        resp = await httpc.fetch(app.port, "GET", "/api/upstreams", headers=bearer(ADMIN))
        assert resp.status == 200
        doc = resp.json()
        assert (doc["ready"], doc["reason"], doc["probing"]) == (True, "ok", True)
        a, b = doc["upstreams"]
        assert list(a) == [
            "name",
            "url",
            "state",
            "since",
            "probed_at",
            "probe_status",
            "error",
            "parallel",
            "in_flight",
            "queued",
        ]
        assert (a["name"], a["url"], a["state"], a["probe_status"], a["error"]) == (
            "a",
            sim.url,
            "ready",
            200,
            None,
        )
        assert (b["name"], b["url"], b["state"], b["probe_status"]) == (
            "b",
            f"http://127.0.0.1:{down}",
            "down",
            None,
        )
        assert "Connection refused" in b["error"]
        now = time.time()
        assert all(now - 60 < u["since"] <= u["probed_at"] <= now for u in (a, b))
        assert (a["parallel"], a["in_flight"], a["queued"]) == (4, 0, 0)
    finally:
        await app.stop(drain_timeout_s=0.5)


async def test_the_probe_logs_each_change_and_requests_finding_it_down_one_line():
    port = closed_port()
    app = await relay(
        [f"http://127.0.0.1:{port}"], health_interval_s=60.0, down_probe_interval_s=0.05
    )
    log = app.log
    try:
        # the first probe: never up, so it is not said to have been ready
        await wait_for(lambda: log.events("upstream_state"))
        [first] = log.events("upstream_state")
        assert (first["state"], first["was"], first["seen_by"]) == ("down", "unknown", "probe")
        assert "Connection refused" in first["error"]
        sim = Simulator(port=release(port))
        await sim.start()
        try:
            await wait_for(lambda: len(log.events("upstream_state")) == 2)
        finally:
            await sim.stop()
        back = log.events("upstream_state")[1]
        assert (back["state"], back["was"], back["seen_by"], back["status"]) == (
            "ready",
            "down",
            "probe",
            200,
        )
        # gone again between two probes (a minute apart): five requests, one line
        for _ in range(5):
            resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2, stream=False))
            assert resp.status == 502
        changes = log.events("upstream_state")[2:]
        assert [(e["state"], e["was"], e["seen_by"]) for e in changes] == [
            ("down", "ready", "request")
        ]
        assert "Connection refused" in changes[0]["error"]
    finally:
        await app.stop(drain_timeout_s=0.5)


async def test_without_probes_requests_log_the_way_down_and_back_once_each():
    port = closed_port()
    app = await relay([f"http://127.0.0.1:{port}"])
    log = app.log
    try:
        for _ in range(5):
            resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2, stream=False))
            assert resp.status == 502
        sim = Simulator(port=release(port))
        await sim.start()
        try:
            for _ in range(5):
                resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2, stream=False))
                assert resp.status == 200
        finally:
            await sim.stop()
        changes = log.events("upstream_state")
        assert [(e["state"], e["was"], e["seen_by"]) for e in changes] == [
            ("down", "unknown", "request"),
            ("ready", "down", "request"),
        ]
        assert "Connection refused" in changes[0]["error"] and "error" not in changes[1]
    finally:
        await app.stop(drain_timeout_s=0.5)
