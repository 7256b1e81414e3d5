"""relay/http/body.py without sockets: each framing's reader fed bytes as an upstream sends them,
as h11's readers are tested. What may go on (`wire`), where its payloads are (`spans`), and
when the body is whole."""

from __future__ import annotations

import pytest

from relay.http.body import ChunkedReader, ChunkError, LengthReader, UntilCloseReader, reader_for
from relay.http.response_framing import BodyKind


def payloads(read) -> list[bytes]:
    wire, spans = read[0], read[1]
    return [wire[spans[i] : spans[i + 1]] for i in range(0, len(spans), 2)]


def test_the_reader_is_chosen_by_the_heads_framing():
    assert isinstance(reader_for(BodyKind.CHUNKED, -1), ChunkedReader)
    assert isinstance(reader_for(BodyKind.LENGTH, 5), LengthReader)
    assert isinstance(reader_for(BodyKind.UNTIL_CLOSE, -1), UntilCloseReader)
    assert reader_for(BodyKind.EMPTY, 0) is None


def test_a_length_body_ends_at_its_length_and_drops_what_follows():
    r = LengthReader(7)
    assert r.read(b"abc") == (b"abc", [0, 3], False, False)
    assert r.read(b"defgHTTP/1.1") == (b"defg", [0, 4], True, False)
    assert not r.reusable and not r.eof()


def test_a_length_body_read_exactly_is_reusable():
    r = LengthReader(3)
    assert r.read(b"abc") == (b"abc", [0, 3], True, False) and r.reusable


def test_whole_chunks_are_read_in_place():
    r = ChunkedReader()
    data = b"3\r\nabc\r\n2\r\nde\r\n"
    read = r.read(data)
    assert read[0] is data and payloads(read) == [b"abc", b"de"] and not read[2] and read[3]
    assert r.between_chunks


def test_a_chunk_split_across_reads_holds_its_size_line_back():
    r = ChunkedReader()
    assert payloads(r.read(b"5\r\nhel")) == [b"hel"] and not r.between_chunks
    wire, spans, whole, chunks = r.read(b"lo\r\n1")
    assert (wire, payloads((wire, spans)), whole, chunks) == (b"lo\r\n", [b"lo"], False, False)
    wire, spans, whole, _ = r.read(b"0\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n")
    assert wire == b"10\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n" and whole and r.reusable
    assert r.payload(wire, spans) == b"x" * 16


def test_bytes_after_the_last_chunk_make_the_connection_unusable():
    r = ChunkedReader()
    assert r.read(b"0\r\n\r\nHTTP/1.1 200 OK\r\n")[2] and not r.reusable


def test_broken_chunk_framing_is_an_error():
    with pytest.raises(ChunkError):
        ChunkedReader().read(b"zz\r\nabc\r\n")


def test_a_close_ends_only_a_close_delimited_body():
    r = UntilCloseReader()
    assert r.read(b"anything") == (b"anything", [0, 8], False, False)
    assert r.eof() and not r.reusable
    assert not LengthReader(3).eof() and not ChunkedReader().eof()


def test_whole_chunks_then_the_last_chunk_are_read_in_place_and_end_the_body():
    r = ChunkedReader()
    data = b"3\r\nabc\r\n0\r\n\r\n"
    read = r.read(data)
    assert read[0] is data and payloads(read) == [b"abc"] and read[2] and read[3]
    assert r.done and r.reusable
    r = ChunkedReader()
    assert r.read(b"0\r\n\r\n") == (b"0\r\n\r\n", [], True, True)
    # A trailer is the general path's: it is whole only once the trailer ends.
    r = ChunkedReader()
    read = r.read(b"3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n")
    assert read[2] and not read[3] and payloads(read) == [b"abc"]
