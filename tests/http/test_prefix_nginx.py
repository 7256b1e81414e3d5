"""An upstream path prefix in front of a real nginx (issue 21 item 2), over real sockets.

nginx serves the prefix (`/api/v1/`, answering the path it resolved), a `/secret` location
beside it and everything else from `location /`, each location with its own access log.
nginx percent-decodes a path once and resolves the dot segments that decoding makes
(`/api/v1/..%2f..%2fsecret` is `/secret` to it). Every escape variant gets 400 bad_request
from the relay and none reaches nginx at all: its logs hold the legitimate requests only.
"""

from __future__ import annotations

import json
import os

import pytest

from bench import nginx, procs
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.need import missing

CONF = """\
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
{user}
events {{ worker_connections 64; }}
http {{
    log_format seen '$request_uri -> $uri';
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    default_type text/plain;
    server {{
        listen 127.0.0.1:{port};
        location /api/v1/ {{ access_log {tmp}/prefix.log seen; return 200 "in $uri"; }}
        location /secret {{ access_log {tmp}/secret.log seen; return 200 "SECRET"; }}
        location / {{ access_log {tmp}/outside.log seen; return 404 "outside $uri"; }}
    }}
}}
"""

# Each of these left /api/v1 in front of nginx before issue 21 (a 200 "SECRET", or nginx's
# `location /`) or would in front of a server that reads `\`, `;` or a second decoding as
# nginx does not.
VARIANTS = [
    "/v1/..%2f..%2fsecret",
    "/v1/..%2F..%2Fsecret",
    "/v1/%2e%2e%2f%2e%2e%2fsecret",
    "/v1/%2E%2e%2F%2e%2E%2fsecret",
    "/v1/x%2f..%2f..%2f..%2fsecret",
    "/v1/..%2f..",
    "/v1/.%2e/.%2e/secret",
    "/v1/..%5c..%5csecret",
    "/v1/..\\..\\secret",
    "/v1/%252e%252e/%252e%252e/secret",
    "/v1/..%252f..%252fsecret",
    "/v1/models/..;/..;/..;/secret",
    "/v1/%2e%2e%2f%2e%2e%2fsecret?x=1",
    "/v1/x#/../../secret",
    "http://relayhost/v1/../../secret",
    "http://relayhost/v1/..%2f..%2fsecret",
    "HTTP://relayhost/v1/%2e%2e%2f%2e%2e%2fsecret",
    "http:///v1/..%2f..%2fsecret",
    "http:/v1/../../secret",
]
# (client target, what nginx's log says it was sent and resolved it to)
LEGIT = [
    ("/v1/chat/completions", "/api/v1/chat/completions -> /api/v1/chat/completions"),
    ("/v1/models/org%2Fname", "/api/v1/models/org%2Fname -> /api/v1/models/org/name"),
    ("/v1/files/a..b/.c", "/api/v1/files/a..b/.c -> /api/v1/files/a..b/.c"),
    ("/v1/x?q=../../secret", "/api/v1/x?q=../../secret -> /api/v1/x"),
    ("http://relayhost/v1/embeddings", "/api/v1/embeddings -> /api/v1/embeddings"),
]


@pytest.fixture
def origin(tmp_path):
    """nginx on a free port serving CONF; its temp dir (logs in it)."""
    if not nginx.binary():
        missing("needs nginx (apt-get install nginx-light)")
    tmp = tmp_path / "nginx"
    tmp.mkdir()
    port = procs.free_port()
    conf = tmp / "nginx.conf"
    user = "user root root;" if os.geteuid() == 0 else ""  # (bench/nginx.py's reason)
    conf.write_text(CONF.format(tmp=tmp, port=port, user=user))
    proc = procs.Proc("nginx", nginx.argv(tmp, conf), tmp)
    try:
        proc.wait_http("127.0.0.1", port, "/api/v1/ready")
        yield port, tmp
    finally:
        proc.stop()


def _log(tmp, name: str) -> list[str]:
    path = tmp / f"{name}.log"
    return path.read_text().splitlines() if path.exists() else []


async def test_no_target_leaves_the_prefix_in_front_of_real_nginx(make_relay, origin):
    port, tmp = origin
    app = await make_relay(url=f"http://127.0.0.1:{port}/api/v1")
    ready = _log(tmp, "prefix")
    assert ready == ["/api/v1/ready -> /api/v1/ready"]  # (the fixture's own probe)
    answers = {}
    for target in VARIANTS:
        resp = await httpc.fetch(app.port, "GET", target)
        body = resp.json() if resp.header("content-type") == "application/json" else resp.body
        answers[target] = (resp.status, body)
    refusal = {
        "error": {
            "message": "upstream llm: dot segments (however encoded) are not allowed under a "
            "path prefix",
            "type": "invalid_request_error",
            "code": "bad_request",
            "param": None,
            "details": {"upstream": "llm"},
        }
    }
    refusal_no_origin = json.loads(json.dumps(refusal))
    refusal_no_origin["error"]["message"] = (
        "upstream llm: a path prefix needs an origin-form request target"
    )
    want = dict.fromkeys(VARIANTS, (400, refusal))
    want["http:/v1/../../secret"] = (400, refusal_no_origin)  # (absolute-form, no authority)
    assert answers == want
    for target, seen in LEGIT:
        resp = await httpc.fetch(app.port, "GET", target)
        assert (resp.status, resp.body) == (200, b"in " + seen.split(" -> ")[1].encode())
    # nginx logs a request after its answer is sent: wait (bounded) for the last line
    want_log = ready + [seen for _, seen in LEGIT]
    await wait_for(lambda: len(_log(tmp, "prefix")) >= len(want_log), timeout=5, step=0.02)
    assert _log(tmp, "secret") == [] and _log(tmp, "outside") == []
    assert _log(tmp, "prefix") == want_log
