"""relay/proxy/client_writer.py with a fake transport: the one writer of a client connection
frames what it must, counts a relayed body's bytes as they went on the wire, and notes the
first byte's time; the relay's own answers are not a relayed body."""

from __future__ import annotations

from relay.http.chunked import LAST_CHUNK, frame
from relay.proxy.client_writer import ClientWriter
from relay.stream.content_hold import Out
from tests.support.fake_loop import FakeLoop


class Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass


def writer() -> tuple[ClientWriter, FakeLoop, list[bytes]]:
    loop, transport = FakeLoop(), Transport()
    return ClientWriter(loop, transport), loop, transport.out


def test_a_relayed_head_and_pieces_go_in_one_write_counting_only_the_body():
    w, loop, out = writer()
    loop.now = 5.0
    w.write(Out(b"HEAD\r\n\r\n", (b"one", b"two"), frames=False))
    assert out == [b"HEAD\r\n\r\nonetwo"] and w.sent == 6
    assert w.first_at is not None and w.last_at == 5.0


def test_pieces_the_relay_frames_are_a_chunk_each_and_end_with_the_last_chunk():
    w, _loop, out = writer()
    w.write(Out(b"H", (b"abc", b"", b"de"), frames=True))
    w.body(b"f")
    w.end()
    assert out == [b"H" + frame(b"abc") + frame(b"de"), frame(b"f"), LAST_CHUNK]
    assert w.sent == len(frame(b"abc") + frame(b"de") + frame(b"f") + LAST_CHUNK)


def test_the_upstreams_own_chunks_pass_as_they_are_once_both_sides_are_between_chunks():
    w, _loop, out = writer()
    w.write(Out(b"H", (), frames=True))
    w.pass_upstream_chunks()
    w.relay(b"3\r\nabc\r\n")
    w.end()
    assert out == [b"H", b"3\r\nabc\r\n"] and w.sent == 8


def test_the_relays_own_answer_counts_its_body_and_no_first_byte():
    w, _loop, out = writer()
    w.answer(404, b'{"error":{}}', b"rid", True)
    assert out[0].startswith(b"HTTP/1.1 404 Not Found\r\n") and out[0].endswith(b'{"error":{}}')
    # Its body is what the client got (a row's bytes_out); its first byte is no relayed
    # response's.
    assert (w.sent, w.first_at) == (len(b'{"error":{}}'), None)
    w.send_answer(b"HTTP/1.1 100 Continue\r\n\r\n")  # an interim response has no body
    assert w.sent == len(b'{"error":{}}')


def test_a_new_response_starts_its_figures_from_nothing():
    w, _loop, _out = writer()
    w.write(Out(b"H", (b"x",), frames=True))
    w.begin()
    assert (w.sent, w.first_at, w.frames) == (0, None, False)


def test_nothing_is_written_once_the_connection_is_gone():
    w, _loop, out = writer()
    w.closed()
    w.write(Out(b"H", (b"x",)))
    w.body(b"y")
    w.answer(200, b"z", None, False)
    w.end()
    assert out == [] and w.sent == 0
