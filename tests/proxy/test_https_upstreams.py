"""https:// upstreams over real sockets (issue 12): a local TLS server, certificates made here.

The upstreams are the simulator and scripted peers served over TLS with a private CA made by
trustme; the relay trusts it through `ca_file` (or not, to see a refusal). Handshakes are
counted on the server side: a TLS server's protocol sees `connection_made` only after one.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import types

import pytest

from relay.config import ConfigError, UpstreamConfig
from relay.sim.server import SimDefaults, Simulator
from tests.support import httpc
from tests.support.fakeup import Scripted, response_of
from tests.support.fixtures import FIXTURES
from tests.support.helpers import wait_for
from tests.support.need import need_extra

trustme = need_extra("test", "trustme")

ROW = (
    "SELECT upstream_requested, upstream_served, fallback_attempts, status, ok, error_code, "
    "error, prompt_tokens, completion_tokens, tokens_source FROM request"
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ns = types.SimpleNamespace(
        ca=ca,
        cert=ca.issue_cert("localhost", "127.0.0.1"),
        wrong_name=ca.issue_cert("wrong.example"),
        ca_file=str(d / "ca.pem"),
        other_file=str(d / "other.pem"),
    )
    ca.cert_pem.write_to_path(ns.ca_file)
    other.cert_pem.write_to_path(ns.other_file)
    return ns


def server_ctx(cert) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    return ctx


def client_ctx(pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    pki.ca.configure_trust(ctx)
    return ctx


@pytest.fixture
async def tls_sim(pki):
    s = Simulator(ssl=server_ctx(pki.cert))
    await s.start()
    yield s
    await s.stop()


def remote(url: str, pki=None, name: str = "remote", **kw) -> UpstreamConfig:
    if pki is not None:
        kw.setdefault("ca_file", pki.ca_file)
    return UpstreamConfig(name=name, url=url, parallel=64, **kw)


async def rows(app) -> list[dict]:
    app.store.flush(timeout=10)
    return app.store.query(ROW)


def replay(raw: bytes, pieces: int = 1, keep: bool = False):
    async def script(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            step = max(1, len(raw) // pieces)
            for i in range(0, len(raw), step):
                writer.write(raw[i : i + step])
                await writer.drain()
            if not keep:
                return

    return script


# ---- 1. streams byte-identical through the relay ------------------------------------------
@pytest.mark.parametrize("name", ["chat_stream.http", "chat_stream_usage.http"])
async def test_captured_stream_is_byte_identical_through_the_relay_over_tls(make_relay, pki, name):
    raw = response_of((FIXTURES / name).read_bytes())
    up_body = raw.partition(b"\r\n\r\n")[2]
    up = await Scripted(replay(raw, pieces=7), ssl=server_ctx(pki.cert)).start()
    app = await make_relay(upstreams=[remote(up.url, pki)])
    direct = await httpc.fetch(
        up.port, "POST", "/v1/chat/completions", httpc.chat(8), ssl=client_ctx(pki)
    )
    relayed = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(8))
    assert relayed.complete and direct.complete
    assert relayed.raw_body == direct.raw_body == up_body  # chunk framing included
    [row] = await rows(app)
    assert (row["upstream_served"], row["status"], row["ok"], row["tokens_source"]) == (
        "remote",
        200,
        1,
        "exact",
    )
    await up.stop()


async def test_simulator_stream_over_tls_matches_direct(make_relay, pki, tls_sim):
    app = await make_relay(upstreams=[remote(tls_sim.url, pki)])
    mask = re.compile(rb'"(id|created)":("chatcmpl-[A-Za-z0-9]+"|\d+)|"timings":\{[^}]*\}')
    direct = await httpc.fetch(
        tls_sim.port, "POST", "/v1/chat/completions", httpc.chat(40), ssl=client_ctx(pki)
    )
    relayed = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(40))
    assert relayed.complete and direct.complete
    # ids, times and measured timings (so the final chunk's size) differ per request
    assert mask.sub(b"", relayed.body) == mask.sub(b"", direct.body)
    assert relayed.raw_body.count(b"\r\n") == direct.raw_body.count(b"\r\n")  # same chunks
    [row] = await rows(app)
    assert (row["completion_tokens"], row["tokens_source"], row["ok"]) == (40, "exact", 1)


# ---- 1. verification: wrong CA, wrong name, system store, verify = false ---------------------
async def _refused(app, words: str) -> None:
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(2))
    assert resp.status == 502
    err = resp.json()["error"]
    assert err["code"] == "upstream_unavailable"
    assert words in err["message"] and words in err["details"]["error"]
    [row] = await rows(app)
    assert (row["status"], row["ok"], row["error_code"]) == (502, 0, "upstream_unavailable")
    assert words in row["error"]


async def test_untrusted_ca_is_a_502_naming_the_tls_reason(make_relay, pki, tls_sim):
    app = await make_relay(upstreams=[remote(tls_sim.url, ca_file=pki.other_file)])
    await _refused(
        app,
        "TLS handshake failed: certificate verify failed: unable to get local issuer certificate",
    )
    assert tls_sim.requests == []


async def test_system_store_does_not_trust_a_private_ca(make_relay, tls_sim):
    app = await make_relay(upstreams=[remote(tls_sim.url)])  # no ca_file: the system store
    await _refused(app, "certificate verify failed: unable to get local issuer certificate")


async def test_hostname_mismatch_is_a_502_naming_the_tls_reason(make_relay, pki):
    up = await Scripted(
        replay(b"HTTP/1.1 204 No Content\r\n\r\n"), ssl=server_ctx(pki.wrong_name)
    ).start()
    app = await make_relay(upstreams=[remote(f"https://localhost:{up.port}", pki)])
    await _refused(
        app,
        "certificate verify failed: hostname mismatch, certificate is not valid for 'localhost'",
    )
    assert up.heads == []
    await up.stop()


async def test_tls_failure_falls_back_before_the_first_token(make_relay, pki, tls_sim, sim):
    app = await make_relay(
        upstreams=[
            remote(tls_sim.url, ca_file=pki.other_file, fallback=["local"]),
            UpstreamConfig(name="local", url=sim.url, parallel=64),
        ]
    )
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert resp.status == 200 and resp.complete
    [row] = await rows(app)
    assert (
        row["upstream_requested"],
        row["upstream_served"],
        row["fallback_attempts"],
        row["ok"],
        row["error"],
    ) == ("remote", "local", 1, 1, None)
    [fb] = app.log.of("fallback")
    assert fb["upstream"] == "remote" and fb["reason"] == "upstream_unavailable"
    assert "unable to get local issuer certificate" in fb["error"]


async def test_verify_false_connects_and_is_logged_at_start(make_relay, tls_sim):
    app = await make_relay(upstreams=[remote(tls_sim.url, verify=False)])
    [ev] = app.log.of("upstream_tls_unverified")
    assert ev["upstream"] == "remote" and ev["url"] == tls_sim.url
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(2))
    assert resp.status == 200 and resp.complete


async def test_unreadable_ca_file_stops_the_start(make_relay, tmp_path):
    with pytest.raises(
        ConfigError, match=r'^upstream\[0\] \(name "remote"\)\.ca_file: cannot load'
    ):
        await make_relay(
            upstreams=[remote("https://127.0.0.1:1", ca_file=str(tmp_path / "missing.pem"))]
        )


async def test_health_probe_speaks_tls(make_relay, pki, tls_sim):
    app = await make_relay(upstreams=[remote(tls_sim.url + "/v1", pki)], health_interval_s=0.05)
    await wait_for(lambda: any(r.path == "/v1/health" for r in tls_sim.requests))
    assert app.upstreams["remote"].health.probe == "ready"
    bad = await make_relay(
        upstreams=[remote(tls_sim.url, ca_file=pki.other_file)], health_interval_s=0.05
    )
    await wait_for(lambda: bad.upstreams["remote"].health.probe == "down")
    assert "unable to get local issuer certificate" in bad.upstreams["remote"].health.last_error


# ---- 3. path prefixes and Host -----------------------------------------------------------
def _ok_json(keep: bool = True):
    body = b'{"ok":true}'
    return replay(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
        b"\r\n\r\n%s" % (len(body), body),
        keep=keep,
    )


async def test_prefix_joined_over_tls_with_the_v1_rule(make_relay, pki):
    up = await Scripted(_ok_json(), ssl=server_ctx(pki.cert)).start()
    app = await make_relay(upstreams=[remote(up.url + "/api/v1/", pki)])
    for path in ("/v1/chat/completions", "/chat/completions", "/v1/models?x=1"):
        resp = await httpc.fetch(app.port, "POST", path, httpc.chat(1, False))
        assert resp.status == 200
    lines = [h.split(b"\r\n")[0] for h in up.heads]
    assert lines == [
        b"POST /api/v1/chat/completions HTTP/1.1",
        b"POST /api/v1/chat/completions HTTP/1.1",
        b"POST /api/v1/models?x=1 HTTP/1.1",
    ]
    hosts = {line for h in up.heads for line in h.split(b"\r\n") if line.startswith(b"Host:")}
    assert hosts == {b"Host: 127.0.0.1:%d" % up.port}  # not the default 443: the port is named
    # a path that could climb out of the prefix is refused, and never sent
    resp = await httpc.fetch(app.port, "POST", "/v1/../admin", httpc.chat(1, False))
    assert resp.status == 400 and resp.json()["error"]["code"] == "bad_request"
    assert len(up.heads) == 3
    await up.stop()


# ---- 2. pooling and prewarm over TLS ------------------------------------------------------
async def test_pooled_tls_connection_is_reused_without_a_new_handshake(make_relay, pki, tls_sim):
    app = await make_relay(upstreams=[remote(tls_sim.url, pki)])
    for _ in range(5):  # non-streamed answers keep the connection (as llama-server does)
        resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(2, False))
        assert resp.status == 200
    assert len(tls_sim.requests) == 5
    assert tls_sim.connections_opened == 1 and app.upstreams["remote"].pool.connects == 1


async def test_streams_to_a_keep_alive_tls_upstream_share_one_handshake(make_relay, pki):
    s = Simulator(defaults=SimDefaults(keep_streams=True), ssl=server_ctx(pki.cert))
    await s.start()
    app = await make_relay(upstreams=[remote(s.url, pki)])
    for _ in range(5):
        resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(4))
        assert resp.status == 200 and resp.complete
    assert s.connections_opened == 1 and len(s.requests) == 5
    await s.stop()


async def test_prewarm_hands_the_next_stream_a_connection_already_through_its_handshake(
    make_relay, pki, tls_sim
):
    app = await make_relay(upstreams=[remote(tls_sim.url, pki)])
    pool = app.upstreams["remote"].pool
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert resp.complete  # llama-server (the simulator) closes after a stream: a spare follows
    await wait_for(lambda: len(pool.idle) == 1 and tls_sim.connections_opened == 2)
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert resp.complete
    # the second stream took the spare: its request came on the second connection, and no
    # handshake was made for it on the request path
    await wait_for(lambda: tls_sim.connections_opened == 3)  # the next spare
    assert len(tls_sim.requests) == 2 and pool.connects == 3


# ---- 4. static headers, the upstream's own key, the client's credential ----------------------
async def test_remote_key_from_environment_static_headers_no_client_credential(
    make_relay, pki, monkeypatch
):
    monkeypatch.setenv("RELAY_TEST_REMOTE_KEY", "Bearer sk-remote")
    up = await Scripted(_ok_json(), ssl=server_ctx(pki.cert)).start()
    app = await make_relay(
        upstreams=[
            remote(
                up.url + "/v1",
                pki,
                auth_header="Authorization",
                auth_value_env="RELAY_TEST_REMOTE_KEY",
                headers={"OpenAI-Organization": "org-x"},
            )
        ]
    )
    resp = await httpc.fetch(
        app.port,
        "POST",
        "/v1/chat/completions",
        httpc.chat(1, False),
        headers={
            "Authorization": "Bearer sk-client",
            "api-key": "az",
            "x-api-key": "xk",
            "OpenAI-Organization": "org-client",
            "Cookie": "session=1",
            "Accept-Encoding": "gzip, br",
        },
    )
    assert resp.status == 200
    head = up.heads[0].decode()
    assert "Authorization: Bearer sk-remote\r\n" in head
    assert "OpenAI-Organization: org-x\r\n" in head
    # the relay reads what passes (tokens, usage): it asks for an unencoded body
    assert "Accept-Encoding: identity\r\n" in head and "gzip" not in head
    for leak in ("sk-client", "az", "xk", "org-client", "session=1"):
        assert leak not in head.replace("Authorization", "").replace("OpenAI-Org", "")
    assert "sk-remote" not in repr(app.log.lines)
    await up.stop()


# ---- 5. a hosted API: no timings, usage only when asked, 429 + Retry-After, keep-alive ----------
def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def hosted_stream(n: int, include_usage: bool) -> bytes:
    """What OpenAI's API sends for a stream: no timings; with include_usage a `usage: null` on
    every chunk and a last chunk with empty choices and the usage."""
    u = b',"usage":null' if include_usage else b""
    pre = (
        b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk","created":1,'
        b'"model":"gpt-4o-mini","system_fingerprint":"fp_1","choices":[{"index":0,'
    )
    events = [
        pre + b'"delta":{"role":"assistant","content":"","refusal":null},'
        b'"logprobs":null,"finish_reason":null}]' + u + b"}\n\n"
    ]
    events += [
        pre + b'"delta":{"content":"t%d"},"logprobs":null,"finish_reason":null}]%s}\n\n' % (i, u)
        for i in range(n)
    ]
    events.append(pre + b'"delta":{},"logprobs":null,"finish_reason":"stop"}]' + u + b"}\n\n")
    if include_usage:
        events.append(
            b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk",'
            b'"created":1,"model":"gpt-4o-mini","system_fingerprint":"fp_1",'
            b'"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":%d,'
            b'"total_tokens":%d}}\n\n' % (n, n + 9)
        )
    events.append(b"data: [DONE]\n\n")
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n"
        b"openai-processing-ms: 120\r\n\r\n" + b"".join(map(_chunk, events)) + b"0\r\n\r\n"
    )


def hosted_api():
    """Keeps every connection; streams as above; a body {"sim":{"status":429}} gets a 429."""

    async def script(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            body = json.loads(up.bodies[-1])
            if (body.get("sim") or {}).get("status") == 429:
                err = (
                    b'{"error":{"message":"Rate limit reached","type":"requests",'
                    b'"param":null,"code":"rate_limit_exceeded"}}'
                )
                writer.write(
                    b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json"
                    b"\r\nRetry-After: 7\r\nContent-Length: %d\r\n\r\n%s" % (len(err), err)
                )
                continue
            usage = (body.get("stream_options") or {}).get("include_usage") is True
            writer.write(hosted_stream(body.get("max_tokens", 3), usage))
            await writer.drain()

    return script


async def test_hosted_api_usage_exact_when_sent_estimated_otherwise(make_relay, pki):
    up = await Scripted(hosted_api(), ssl=server_ctx(pki.cert)).start()
    app = await make_relay(upstreams=[remote(up.url + "/v1", pki)])
    plain = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(5))
    asked = dict(httpc.chat(6), stream_options={"include_usage": True})
    with_usage = await httpc.fetch(app.port, "POST", "/v1/chat/completions", asked)
    assert plain.complete and with_usage.complete
    assert plain.raw_body == hosted_stream(5, False).partition(b"\r\n\r\n")[2]
    assert with_usage.raw_body == hosted_stream(6, True).partition(b"\r\n\r\n")[2]
    first, second = await rows(app)
    assert (first["completion_tokens"], first["tokens_source"], first["ok"]) == (5, "approx", 1)
    assert (second["prompt_tokens"], second["completion_tokens"], second["tokens_source"]) == (
        9,
        6,
        "exact",
    )
    # the hosted API keeps the connection: one handshake, and the pool holds it for minutes
    # (not the 4 s that suit llama-server)
    pool = app.upstreams["remote"].pool
    assert up.connections == 1 and pool.keepalive_s == 60.0 and len(pool.idle) == 1
    loop = asyncio.get_running_loop()
    assert pool.idle[0].idle_timer.when() - loop.time() > 50
    await up.stop()


async def test_hosted_429_falls_back_to_the_next_candidate(make_relay, pki, tls_sim):
    async def limited(up, index, reader, writer):
        while await up.read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                b"Retry-After: 7\r\nContent-Length: 2\r\n\r\n{}"
            )

    up = await Scripted(limited, ssl=server_ctx(pki.cert)).start()
    app = await make_relay(
        upstreams=[
            remote(up.url, pki, fallback=["backup"]),
            remote(tls_sim.url, pki, name="backup"),
        ]
    )
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert resp.status == 200 and resp.complete and resp.header("retry-after") is None
    [row] = await rows(app)
    assert (row["upstream_served"], row["fallback_attempts"], row["ok"]) == ("backup", 1, 1)
    # as the last candidate, its 429 reaches the client verbatim, Retry-After included
    solo = await make_relay(upstreams=[remote(up.url, pki)])
    resp = await httpc.fetch(solo.port, "POST", "/v1/chat/completions", httpc.chat(3))
    assert (resp.status, resp.header("retry-after"), resp.body) == (429, "7", b"{}")
    await up.stop()


# ---- the official client, through the relay, to the TLS upstream --------------------------
async def test_openai_client_through_relay_to_tls_upstream(make_relay, pki, tls_sim):
    openai = need_extra("test", "openai")
    app = await make_relay(upstreams=[remote(tls_sim.url + "/v1", pki)])
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{app.port}/v1", api_key="sk-test", max_retries=0, timeout=10
    )
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    whole = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=5
    )
    await client.close()
    assert "".join(text) == httpc.sim_text(12)
    assert usage.completion_tokens == 12
    assert whole.choices[0].message.content == httpc.sim_text(5)
    assert [r.path for r in tls_sim.requests] == ["/v1/chat/completions"] * 2
    for r in tls_sim.requests:  # the client accepts gzip; the relay asks for identity
        assert [v for k, v in r.headers if k == b"accept-encoding"] == [b"identity"]


# ---- backpressure holds over TLS too --------------------------------------------------------
async def test_slow_reader_pauses_the_tls_upstream(make_relay, pki, tls_sim):
    from relay.proxy.client_writer import WRITE_HIGH_WATER
    from tests.support.helpers import settled
    from tests.support.sockets import READ_SIZE, paused_stream

    app = await make_relay(upstreams=[remote(tls_sim.url, pki)])
    n = 60000
    reader, writer, resp, client, ex = await paused_stream(app, n)
    sent = await settled(lambda: tls_sim.requests[-1].tokens_sent)
    buffered = client.transport.get_write_buffer_size() + (ex.reply.hold.size if ex.reply else 0)
    assert buffered <= WRITE_HIGH_WATER + READ_SIZE, buffered
    assert not ex.conn.transport.is_reading()
    assert sent < n * 0.8  # the simulator was held back: TLS passes the pause on
    import socket

    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    await httpc.read_body(reader, resp)
    writer.close()
    assert resp.complete and resp.body.count(b'"delta":{"content":') == n


async def test_a_handshake_that_never_completes_is_bounded_by_the_connect_timeout(make_relay):
    async def silent(up, index, reader, writer):  # takes the TCP connection, says nothing
        await reader.read()

    up = await Scripted(silent).start()
    app = await make_relay(
        upstreams=[remote(f"https://127.0.0.1:{up.port}")], connect_timeout_s=0.2
    )
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(2))
    assert resp.status == 502
    assert resp.json()["error"]["details"]["error"] == "connect timed out after 0.2s"
    await up.stop()


async def test_plain_http_server_behind_an_https_url_is_a_502(make_relay, sim):
    app = await make_relay(upstreams=[remote(sim.url.replace("http://", "https://"))])
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(2))
    assert resp.status == 502 and resp.json()["error"]["code"] == "upstream_unavailable"
    [row] = await rows(app)
    # its plain-text answer is not a TLS record: the reason in words
    assert row["error"] == "TLS handshake failed: wrong version number"


async def test_sni_and_host_come_from_the_url(make_relay, pki):
    names = []
    ctx = server_ctx(pki.cert)
    ctx.sni_callback = lambda sock, name, _ctx: names.append(name)
    up = await Scripted(_ok_json(), ssl=ctx).start()
    app = await make_relay(upstreams=[remote(f"https://localhost:{up.port}", pki)])
    resp = await httpc.fetch(
        app.port,
        "POST",
        "/v1/chat/completions",
        httpc.chat(1, False),
        headers={"Host": "relay.example"},
    )
    assert resp.status == 200
    assert names == ["localhost"]
    assert b"\r\nHost: localhost:%d\r\n" % up.port in up.heads[0]
    await up.stop()


async def test_tls_upstream_drop_mid_stream_is_visible_and_before_content_is_a_502(
    make_relay, pki, tls_sim
):
    app = await make_relay(upstreams=[remote(tls_sim.url, pki)])
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(20, drop_after=3))
    assert resp.status == 200 and not resp.complete  # the cut is not disguised as an end
    assert b"[DONE]" not in resp.body
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(20, drop_after=0))
    assert resp.status == 502 and resp.json()["error"]["code"] == "upstream_unavailable"
    first, second = await rows(app)
    assert (first["ok"], first["error_code"]) == (0, "upstream_dropped")
    assert (second["status"], second["ok"]) == (502, 0)


async def test_reload_applies_ca_file_headers_and_keepalive_in_place(make_relay, pki):
    import msgspec

    up = await Scripted(_ok_json(), ssl=server_ctx(pki.cert)).start()
    app = await make_relay(upstreams=[remote(up.url, ca_file=pki.other_file)])
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(1, False))
    assert resp.status == 502  # the wrong CA
    fixed = remote(up.url, pki, headers={"OpenAI-Project": "p1"}, keepalive_s=120)
    app.reload(msgspec.structs.replace(app.config, upstream=[fixed]))
    resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions", httpc.chat(1, False))
    assert resp.status == 200
    assert b"\r\nOpenAI-Project: p1\r\n" in up.heads[-1]
    assert app.upstreams["remote"].pool.keepalive_s == 120.0
    await up.stop()
