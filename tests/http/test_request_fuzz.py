"""Fuzzed request bytes against a relay over a real socket, h11 as the oracle (issue 10).

Heads and bodies are generated valid and not (Content-Length / Transfer-Encoding combinations,
obs-fold, chunked bodies with odd sizes and extensions, pipelined requests, junk, a flipped
byte). For every byte string:
- the relay answers at most one request more than h11 (as a server) parses whole on the same
  bytes, and that one only with an error (4xx, 501) after which it closes: never two answers
  where h11 sees one request. h11 reads a head with ambiguous framing (CL and TE, TE on
  HTTP/1.0, obs-fold) as chunked where another parser may not: the oracle counts no request
  from such a head on, so nothing after it may be answered (request smuggling);
- it never answers 500 nor logs an internal error;
- every response it sends is well framed (never both Content-Length and Transfer-Encoding).

The relay runs on its own loop in a thread so hypothesis can drive plain blocking sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.app import App
from relay.config import (
    Config,
    DispatcherConfig,
    ServerConfig,
    StoreConfig,
    UpstreamConfig,
)
from relay.observe.log import quiet
from relay.sim.server import Simulator

CHAT = json.dumps(
    {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "stream": False,
    }
).encode()
IDLE_S = 0.15  # the relay's keep-alive and head deadlines here: it closes soon after the bytes


@pytest.fixture(scope="module")
def relay():
    box: dict = {}
    ready = threading.Event()

    def run() -> None:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main() -> None:
            sim = Simulator()
            await sim.start()
            cfg = Config(
                server=ServerConfig(
                    port=0,
                    header_timeout_s=IDLE_S,
                    keepalive_timeout_s=IDLE_S,
                    max_body_bytes=4096,
                    max_body_chunks=64,
                ),
                dispatcher=DispatcherConfig(health_interval_s=0),
                upstream=[UpstreamConfig(name="llm", url=sim.url, parallel=16)],
                store=StoreConfig(path=":memory:"),
            )
            app = App(cfg, quiet())
            await app.start()
            box.update(app=app, loop=loop, stop=asyncio.Event())
            ready.set()
            await box["stop"].wait()
            await app.stop(drain_timeout_s=0.5)
            await sim.stop()

        loop.run_until_complete(main())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield box["app"]
    box["loop"].call_soon_threadsafe(box["stop"].set)
    thread.join(10)


# ---- generation -----------------------------------------------------------------------------
def chunk_line(draw, size: int) -> bytes:
    text = draw(st.sampled_from(["%x", "%X", "0%x", "%x ", "%x;a=b", '%x;ext="q"'])) % size
    return text.encode() + b"\r\n"


@st.composite
def chunked_body(draw, body: bytes) -> bytes:
    out, i = [], 0
    while i < len(body):
        n = draw(st.integers(1, max(1, len(body) - i)))
        out.append(chunk_line(draw, n) + body[i : i + n] + b"\r\n")
        i += n
    out.append(
        draw(st.sampled_from([b"0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n", b"000;e\r\n\r\n", b"0\r\n"]))
    )  # last: cut short
    return b"".join(out)


@st.composite
def one_request(draw) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "POST"]))
    path = draw(
        st.sampled_from(
            [
                "/health",
                "/v1/chat/completions",
                "/v1/chat/%63ompletions",
                "//v1/./chat/completions",
                "/nope?x=1",
            ]
        )
    )
    version = draw(st.sampled_from(["1.1", "1.1", "1.0"]))
    body = draw(st.sampled_from([b"", CHAT, CHAT, b"{}", b"[1]", b"x" * 5]))
    framing = draw(
        st.sampled_from(
            ["cl", "cl", "te", "both", "none", "cl-wrong", "te-fold", "te-gzip", "cl-dup", "te-10"]
        )
    )
    lines = [f"{method} {path} HTTP/{version}".encode(), b"Host: r"]
    lines += draw(
        st.lists(
            st.sampled_from(
                [
                    b"Connection: close",
                    b"X-A: b\r\n c",
                    b"Expect: 100-continue",
                    b"Content-Type: text/plain",
                    b"X-Request-Id: abc",
                    b"Connection: keep-alive",
                ]
            ),
            max_size=2,
        )
    )
    cl = b"Content-Length: %d" % len(body)
    te = b"Transfer-Encoding: chunked"
    payload = body
    if framing == "cl":
        lines.append(cl)
    elif framing == "cl-wrong":
        lines.append(b"Content-Length: %d" % max(0, len(body) + draw(st.integers(-3, 3))))
    elif framing == "cl-dup":
        lines += [cl, draw(st.sampled_from([cl, b"Content-Length: 1"]))]
    elif framing in ("te", "both", "te-fold", "te-gzip", "te-10"):
        payload = draw(chunked_body(body))
        lines.append(
            {
                "te": te,
                "both": te,
                "te-10": te,
                "te-fold": b"Transfer-Encoding:\r\n chunked",
                "te-gzip": b"Transfer-Encoding: gzip, chunked",
            }[framing]
        )
        if framing == "both":
            lines.insert(draw(st.integers(1, len(lines))), b"Content-Length: %d" % len(payload))
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    if framing == "te-10":
        head = head.replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    return head + payload


@st.composite
def byte_streams(draw) -> bytes:
    reqs = draw(st.lists(one_request(), min_size=1, max_size=3))
    data = b"".join(reqs)
    if draw(st.booleans()):
        data += draw(
            st.sampled_from(
                [
                    b"",
                    b"\r\n",
                    b"GET / HTTP/1.1\r\n",
                    b"junk\r\n\r\n",
                    b"\x00\xff",
                    b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n",
                ]
            )
        )
    if draw(st.integers(0, 4)) == 0:  # one byte flipped somewhere
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1 :]
    return data


# ---- oracle and reading -----------------------------------------------------------------------
def ambiguous(ev: h11.Request, data: bytes) -> bool:
    """Framing another parser (the upstream) could read differently from h11 (RFC 9112 6.1):
    h11 reads these, but what follows their body must never be answered."""
    names = [k for k, _ in ev.headers]
    head = data.lstrip(b"\r\n").split(b"\r\n\r\n", 1)[0]
    return (
        (
            b"transfer-encoding" in names
            and (b"content-length" in names or ev.http_version == b"1.0")
        )
        or b"\n " in head
        or b"\n\t" in head
    )


def h11_requests(data: bytes) -> int:
    """Requests h11 parses whole, as the relay reads them: a fresh parser after each one,
    stopping before one whose framing is ambiguous."""
    done = 0
    while data:
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(data)
        last = False
        try:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    return done
                if isinstance(ev, h11.Request):
                    if ambiguous(ev, data):
                        return done
                    raw = ev.headers
                    last = ev.http_version == b"1.0" or any(
                        k == b"connection" and b"close" in v.lower() for k, v in raw
                    )
                if isinstance(ev, h11.EndOfMessage):
                    done += 1
                    break
        except h11.RemoteProtocolError:
            return done
        if last:
            return done
        data = bytes(conn.trailing_data[0])
    return done


def read_responses(raw: bytes) -> list[int]:
    """Statuses of the final responses in `raw`, checking each one's framing."""
    statuses = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, raw[:300]
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        fields = [
            (k.strip().lower(), v.strip()) for k, _, v in (ln.partition(b":") for ln in lines[1:])
        ]
        names = [k for k, _ in fields]
        assert not (b"content-length" in names and b"transfer-encoding" in names), head
        assert names.count(b"content-length") <= 1, head
        if status < 200:
            raw = rest
            continue
        statuses.append(status)
        if b"content-length" in names:
            n = int(dict(fields)[b"content-length"])
            assert len(rest) >= n, head
            raw = rest[n:]
        elif b"transfer-encoding" in names:
            while True:
                line, sep, rest = rest.partition(b"\r\n")
                assert sep
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    assert rest.startswith(b"\r\n")
                    rest = rest[2:]
                    break
                assert rest[size : size + 2] == b"\r\n"
                rest = rest[size + 2 :]
            raw = rest
        else:
            raw = b""
    return statuses


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        out = bytearray()
        end = time.monotonic() + 5
        while time.monotonic() < end:
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            out += got
        return bytes(out)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=byte_streams())
def test_relay_never_answers_more_than_h11_parses(relay, data):
    statuses = read_responses(exchange(relay.port, data))
    parsed = h11_requests(data)
    assert 500 not in statuses
    assert len(statuses) <= parsed + 1, (statuses, parsed)
    if len(statuses) == parsed + 1:  # the extra one refuses what h11 could not parse whole
        assert 400 <= statuses[-1] < 500 or statuses[-1] == 501
    assert relay.log.of("internal_error") == []


@pytest.mark.parametrize(
    "data,want",
    [
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /health HTTP/1.1\r\nHost: r\r\n\r\n",
            [400],
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: r\r\n\r\nGET /health HTTP/1.1\r\nHost: r\r\n\r\n",
            [200, 200],
        ),
    ],
)
def test_known_byte_strings(relay, data, want):
    assert read_responses(exchange(relay.port, data)) == want
