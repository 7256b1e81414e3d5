"""Admin endpoints against DNS rebinding and cross-site request forgery, over real sockets and
in a real headless Chromium (issue 21 item 3).

A DNS-rebinding page is one the operator's browser loaded from `attacker.example`, whose name
then resolves to 127.0.0.1: its requests reach the relay from a loopback peer with `Host:
attacker.example[:port]`. A forging page is any page of another origin sending a "simple"
request (text/plain POST, no preflight). Each is refused 403 `forbidden` and reaches no
upstream; curl-like requests (no Origin, no Sec-Fetch-*), the relay's own origin and the
admin key keep working. The rule: relay/policy/admin_access.py, its pure tests:
tests/policy/test_admin_access.py."""

from __future__ import annotations

import json

import pytest

from tests.support import httpc
from tests.support.cdp import Browser, chromium_path
from tests.support.fakeup import Scripted
from tests.support.helpers import error_of, wait_for
from tests.support.keys import ADMIN, bearer, key, sha
from tests.support.need import missing

ERASE = "/slots/0?action=erase"
SIMPLE = {"Content-Type": "text/plain"}  # a CORS-safelisted type: no preflight
EVIL = "http://attacker.example"
UP_ANSWER = b'{"id_slot":0,"n_erased":0}'
NOT_OUR_HOST = (
    "admin endpoints trust a loopback peer only with a Host naming this relay"
    " (localhost, *.localhost, a loopback address or [server].host)"
)
OTHER_ORIGIN = "admin endpoints refuse requests from a browser page of another origin"


async def json_upstream(upstream, index, reader, writer):
    while await upstream.read_request(reader) is not None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(UP_ANSWER) + UP_ANSWER
        )
        await writer.drain()


@pytest.fixture
async def up():
    u = await Scripted(json_upstream).start()
    yield u
    await u.stop()


async def send(port: int, method: str, target: str, headers: dict, body: bytes | None = None):
    """A raw request whose Host (and every other header) is exactly `headers`' own."""
    if body is None and method == "POST":
        body = b"{}"
    headers = {"Host": f"127.0.0.1:{port}", **headers}
    return await httpc.fetch(port, method, target, body, headers=headers)


async def refused(port: int, up: Scripted, method: str, target: str, headers: dict, why: str):
    seen = len(up.heads)
    resp = await send(port, method, target, headers)
    assert resp.status == 403, (method, target, headers, resp.status, resp.body)
    err = error_of(resp)
    assert (err["code"], err["type"], err["message"]) == ("forbidden", "permission_error", why)
    assert len(up.heads) == seen, (method, target, headers)  # never forwarded


async def forwarded(port: int, up: Scripted, method: str, target: str, headers: dict):
    seen = len(up.heads)
    resp = await send(port, method, target, headers)
    assert resp.status == 200 and resp.body == UP_ANSWER, (target, headers, resp.status)
    assert len(up.heads) == seen + 1
    assert up.heads[-1].startswith(f"{method} {target} HTTP/1.1\r\n".encode())


async def test_keys_without_admin_key_refuse_rebinding_and_other_origins(make_relay, up):
    app = await make_relay(url=up.url, keys=[key()])
    p = app.port
    # a rebinding page reads the operator's data: every Host that is not the relay's
    for host in (
        "attacker.example",
        f"attacker.example:{p}",
        f"localhost.attacker.example:{p}",
        f"127.0.0.1.nip.io:{p}",
        f"ATTACKER.example:{p}",
    ):
        for target in ("/api/ui/state", "/metrics", "/api/slots/metrics", "/slots", "/ui"):
            await refused(p, up, "GET", target, {"Host": host}, NOT_OUR_HOST)
        # ... and changes the server from its own origin (same-origin to the browser)
        same = {"Host": host, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
        await refused(p, up, "POST", ERASE, {**same, **SIMPLE}, NOT_OUR_HOST)
        await refused(p, up, "POST", "/models/load", same, NOT_OUR_HOST)
        await refused(p, up, "GET", "/slots", same, NOT_OUR_HOST)
    # a page of another origin, the Host the relay's own: reads and changes refused
    for headers in (
        {"Origin": EVIL},
        {"Origin": EVIL, "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "null", "Sec-Fetch-Site": "cross-site"},  # a sandboxed frame, a file
        # another app on the box (another port: same site, another origin)
        {"Host": f"localhost:{p}", "Origin": "http://localhost:3000", "Sec-Fetch-Site": "same-site"},
    ):  # fmt: skip
        for target in ("/api/ui/state", "/metrics", "/slots"):
            await refused(p, up, "GET", target, headers, OTHER_ORIGIN)
        for method, target in (("POST", ERASE), ("POST", "/props"), ("DELETE", "/models/x")):
            await refused(p, up, method, target, {**headers, **SIMPLE}, OTHER_ORIGIN)
    # a bodiless forged POST is judged after its head, the same way
    await refused(p, up, "POST", ERASE, {"Origin": EVIL, "Content-Length": "0"}, OTHER_ORIGIN)
    # the operator: curl on the box, the relay's own origin, the page files from any link
    for host in (f"127.0.0.1:{p}", f"localhost:{p}", "localhost", f"[::1]:{p}", "relay.localhost"):
        resp = await send(p, "GET", "/api/ui/state", {"Host": host})
        assert resp.status == 200 and "upstreams" in resp.json(), host
    own = {"Origin": f"http://127.0.0.1:{p}", "Sec-Fetch-Site": "same-origin"}
    assert (await send(p, "GET", "/metrics", {"Sec-Fetch-Site": "same-origin"})).status == 200
    assert (await send(p, "GET", "/metrics", {"Sec-Fetch-Site": "none"})).status == 200  # typed
    assert (await send(p, "GET", "/ui", {"Sec-Fetch-Site": "cross-site"})).status == 200
    await forwarded(p, up, "POST", ERASE, {})
    await forwarded(p, up, "POST", ERASE, {**own, **SIMPLE})
    await forwarded(p, up, "GET", "/slots", {"Sec-Fetch-Site": "same-origin"})
    tunnel = {"Host": "localhost:9000", "Origin": "http://localhost:9000"}  # ssh -L 9000:...
    await forwarded(p, up, "POST", ERASE, tunnel)


async def test_no_keys_a_page_of_another_origin_changes_nothing(make_relay, up):
    app = await make_relay(url=up.url, cors_origins=["http://app.example"])
    p = app.port
    for headers in (
        {"Origin": EVIL},
        {"Origin": EVIL, "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": "http://app.example"},  # a configured CORS origin: inference, not admin
    ):
        for method, target in (
            ("POST", ERASE),
            ("POST", "/slots/1?action=save"),
            ("POST", "/props"),
            ("POST", "/lora-adapters"),
            ("POST", "/models/load"),
            ("PUT", "/models/x"),
            ("PATCH", "/props"),
            ("DELETE", "/models/x"),
            ("POST", "/cors-proxy"),
            ("POST", "/api/ui/state"),
            ("POST", "/%73lots/0?action=erase"),
        ):
            await refused(p, up, method, target, {**headers, **SIMPLE}, OTHER_ORIGIN)
    # with no keys the relay is open, as before: curl, its own origin, any Host
    await forwarded(p, up, "POST", ERASE, {})
    await forwarded(p, up, "POST", "/props", {"Origin": f"http://127.0.0.1:{p}"})
    lan = {"Host": f"gpu-box.lan:{p}", "Origin": f"http://gpu-box.lan:{p}"}
    await forwarded(p, up, "POST", "/models/load", lan)
    # the configured origin still gets inference
    seen = len(up.heads)
    resp = await send(p, "POST", "/v1/chat/completions", {"Origin": "http://app.example"}, b"{}")
    assert resp.header("access-control-allow-origin") == "http://app.example"
    assert len(up.heads) == seen + 1


async def test_admin_key_a_page_of_another_origin_changes_nothing(make_relay, up):
    app = await make_relay(url=up.url, keys=[key()], admin_key_sha256=sha(ADMIN))
    p = app.port
    adm = bearer(ADMIN)
    for headers in ({"Origin": EVIL}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": EVIL, **adm}):
        await refused(p, up, "POST", ERASE, {**headers, **SIMPLE}, OTHER_ORIGIN)
        await refused(p, up, "POST", "/props", headers, OTHER_ORIGIN)
    await forwarded(p, up, "POST", ERASE, adm)
    await forwarded(p, up, "POST", ERASE, {**adm, "Origin": f"http://127.0.0.1:{p}"})
    # a read with the key is the key's: from any origin (a dashboard the CORS list allows)
    resp = await send(p, "GET", "/api/ui/state", {**adm, "Origin": EVIL, "Host": "x.example"})
    assert resp.status == 200
    resp = await send(p, "GET", "/api/ui/state", {"Host": "x.example"})
    assert resp.status == 401 and error_of(resp)["code"] == "invalid_api_key"


# ---- in a real browser --------------------------------------------------------------------


@pytest.fixture
async def browser(tmp_path):
    exe = chromium_path()
    if exe is None:
        missing("needs Chromium, not found: apt-get install chromium (.ci/run installs it)")
    # attacker.example resolves to this box: what a rebinding DNS answer makes it
    rules = "--host-resolver-rules=MAP attacker.example 127.0.0.1"
    b = await Browser.start(exe, str(tmp_path / "chromium-profile"), flags=(rules,))
    yield b
    await b.close()


def statuses(app, path: str) -> list[int]:
    return [line["status"] for line in app.log.of("access") if line["path"] == path]


async def test_rebinding_and_forgery_from_chromium(make_relay, up, browser):
    """Chromium's own headers: a page at attacker.example (rebound to the relay) reads nothing
    and erases nothing, a forged no-cors POST from it is refused; the operator page's
    same-origin fetches read and change as before."""
    app = await make_relay(url=up.url, keys=[key()])
    p = app.port
    page = await browser.page()
    await page.navigate(f"http://attacker.example:{p}/ui")  # the relay answers: 403
    assert await page.eval("document.location.origin") == f"http://attacker.example:{p}"
    status = "fetch({!r}, {}).then(r => r.status)"
    assert await page.eval(status.format("/api/ui/state", "{}")) == 403
    erase = json.dumps({"method": "POST", "body": "x", "headers": SIMPLE})
    assert await page.eval(status.format(ERASE, erase)) == 403
    forged = json.dumps({"method": "POST", "body": "x", "headers": SIMPLE, "mode": "no-cors"})
    await page.eval(f"fetch('http://127.0.0.1:{p}{ERASE}', {forged}).then(r => r.type)")
    await wait_for(lambda: len(statuses(app, "/slots/0")) == 2)
    assert statuses(app, "/slots/0") == [403, 403] and up.heads == []
    # the operator's page, same origin
    await page.navigate(f"http://127.0.0.1:{p}/ui")
    assert await page.wait_for("!!document.querySelector('[data-upstream=\"llm\"]')")
    assert await page.eval(status.format("/api/ui/state", "{}")) == 200
    assert await page.eval(status.format(ERASE, erase)) == 200
    assert len(up.heads) == 1 and up.heads[0].startswith(f"POST {ERASE} ".encode())
    sent = up.heads[0].lower()  # what Chromium sent, passed on: its own origin said so
    assert f"\r\norigin: http://127.0.0.1:{p}\r\n".encode() in sent
    assert b"\r\nsec-fetch-site: same-origin\r\n" in sent
    await page.close()
