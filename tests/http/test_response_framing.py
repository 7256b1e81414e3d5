"""Unit tests for relay/http/response_framing.py: upstream body kinds and client carriage."""

from __future__ import annotations

import pytest

from relay.http.response_framing import (
    CHUNK,
    CHUNKED,
    DECHUNK,
    EMPTY,
    LENGTH,
    PASS,
    UNTIL_CLOSE,
    FramingError,
    carriage,
    client_chunked,
    self_delimited,
    upstream_body,
)

TE_CHUNKED = [(b"Transfer-Encoding", b"chunked")]
CL = lambda n: [(b"Content-Length", n)]  # noqa: E731


def test_constants():
    assert (EMPTY, LENGTH, CHUNKED, UNTIL_CLOSE) == ("empty", "length", "chunked", "close")
    assert (PASS, DECHUNK, CHUNK) == ("pass", "dechunk", "chunk")


@pytest.mark.parametrize(
    "method,status,headers,want",
    [
        # HEAD: never a body, whatever the headers say
        (b"HEAD", 200, TE_CHUNKED, (EMPTY, 0)),
        (b"HEAD", 200, CL(b"646"), (EMPTY, 0)),
        (b"HEAD", 200, [], (EMPTY, 0)),
        # 1xx / 204 / 304
        (b"GET", 100, [], (EMPTY, 0)),
        (b"GET", 101, TE_CHUNKED, (EMPTY, 0)),
        (b"POST", 199, CL(b"5"), (EMPTY, 0)),
        (b"POST", 204, TE_CHUNKED, (EMPTY, 0)),
        (b"GET", 304, CL(b"100"), (EMPTY, 0)),
        # chunked
        (b"POST", 200, TE_CHUNKED, (CHUNKED, -1)),
        (b"POST", 200, [(b"transfer-encoding", b"Chunked")], (CHUNKED, -1)),
        (b"POST", 500, TE_CHUNKED, (CHUNKED, -1)),
        (b"POST", 200, [(b"Transfer-Encoding", b" CHUNKED ")], (CHUNKED, -1)),
        # Content-Length
        (b"POST", 200, CL(b"0"), (EMPTY, 0)),
        (b"POST", 200, CL(b"646"), (LENGTH, 646)),
        (b"POST", 404, [(b"content-length", b"74")], (LENGTH, 74)),
        (b"POST", 205, CL(b"3"), (LENGTH, 3)),
        # close-delimited
        (b"POST", 200, [], (UNTIL_CLOSE, -1)),
        (b"GET", 200, [(b"Content-Type", b"text/event-stream")], (UNTIL_CLOSE, -1)),
    ],
)
def test_upstream_body(method, status, headers, want):
    assert upstream_body(method, status, headers) == want


@pytest.mark.parametrize(
    "value",
    [
        b"abc",
        b"",
        b"1.5",
        b"0x10",
        b"-1",
        b"-100",
        b"+5",
        b" 5",
        b"5, 5",
        b"1" * 19,
        b"9" * 5000,
        "\u0665".encode(),
    ],
)
def test_bad_content_length(value):
    with pytest.raises(FramingError):
        upstream_body(b"POST", 200, CL(value))


def test_bad_content_length_ignored_when_no_body_allowed():
    assert upstream_body(b"HEAD", 200, CL(b"junk")) == (EMPTY, 0)
    assert upstream_body(b"POST", 304, CL(b"-1")) == (EMPTY, 0)


def test_eighteen_digits_are_a_length():
    assert upstream_body(b"POST", 200, CL(b"9" * 18)) == (LENGTH, 10**18 - 1)


@pytest.mark.parametrize(
    "headers",
    [
        [(b"Transfer-Encoding", b"chunked, gzip")],  # chunked not final
        [(b"Transfer-Encoding", b"gzip, chunked")],  # the gzip coding would be dropped
        [(b"Transfer-Encoding", b"gzip")],
        [(b"Transfer-Encoding", b"identity")] + CL(b"5"),
        TE_CHUNKED + CL(b"10"),  # ambiguous: never TE-wins-over-CL
        CL(b"10") + TE_CHUNKED,
    ],
)
def test_only_a_lone_chunked_coding_without_a_length_is_carried(headers):
    """(RFC 9112 6.1 / 6.3, as nginx: a 502) http.response_head refuses these heads first."""
    with pytest.raises(FramingError):
        upstream_body(b"POST", 200, headers)


# kind, client_http11 -> (carriage, client sees chunked, self-delimited)
TABLE = [
    (EMPTY, True, PASS, False, True),
    (EMPTY, False, PASS, False, True),
    (LENGTH, True, PASS, False, True),
    (LENGTH, False, PASS, False, True),
    (CHUNKED, True, PASS, True, True),
    (CHUNKED, False, DECHUNK, False, False),
    (UNTIL_CLOSE, True, CHUNK, True, True),
    (UNTIL_CLOSE, False, PASS, False, False),
]


@pytest.mark.parametrize("kind,http11,mode,chunked,delimited", TABLE)
def test_carriage_table(kind, http11, mode, chunked, delimited):
    assert carriage(kind, http11) == mode
    assert client_chunked(kind, mode) is chunked
    assert self_delimited(kind, mode) is delimited


@pytest.mark.parametrize(
    "method,status,headers,http11,want",
    [
        (b"POST", 200, TE_CHUNKED, True, (PASS, True, True)),  # llama-server stream, 1.1 client
        (b"POST", 200, TE_CHUNKED, False, (DECHUNK, False, False)),  # 1.0 client: close-delimited
        (b"POST", 200, CL(b"646"), False, (PASS, False, True)),
        (b"POST", 200, [], True, (CHUNK, True, True)),
        (b"POST", 200, [], False, (PASS, False, False)),
        (b"HEAD", 200, TE_CHUNKED, False, (PASS, False, True)),
        (b"POST", 204, [], True, (PASS, False, True)),
    ],
)
def test_end_to_end_decision(method, status, headers, http11, want):
    kind, _ = upstream_body(method, status, headers)
    mode = carriage(kind, http11)
    assert (mode, client_chunked(kind, mode), self_delimited(kind, mode)) == want


def test_closing_bytes_for_each_carriage():
    from relay.http.chunked import ChunkTracker
    from relay.http.response_framing import (
        CHUNK,
        CHUNKED,
        DECHUNK,
        LENGTH,
        PASS,
        UNTIL_CLOSE,
        closing_bytes,
    )

    t = ChunkTracker()
    t.feed(b"5\r\nhel")  # the client is inside a 5-byte chunk: 2 bytes owed
    assert closing_bytes(CHUNKED, PASS, t, b"xyz") == (b"xy\r\n1\r\nz\r\n0\r\n\r\n", True)
    assert closing_bytes(UNTIL_CLOSE, CHUNK, None, b"xyz") == (b"3\r\nxyz\r\n0\r\n\r\n", True)
    assert closing_bytes(LENGTH, PASS, None, b"xyz") == (b"", False)
    assert closing_bytes(CHUNKED, DECHUNK, None, b"xyz") == (b"xyz", False)
    assert closing_bytes(UNTIL_CLOSE, PASS, None, b"xyz") == (b"xyz", False)
