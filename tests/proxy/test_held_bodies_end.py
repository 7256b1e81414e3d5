"""A close-delimited SSE body that ends while the hold still keeps it (no content event
came) ends with the relay's last chunk for an HTTP/1.1 client, whose connection stays."""

from __future__ import annotations

import asyncio

from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import rows_of

CHAT = "/v1/chat/completions"
ROLE = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}],"model":"m"}\n\n'
)
FINISH = b'data: {"choices":[{"index":0,"finish_reason":"stop","delta":{}}],"model":"m"}\n\n'
DONE = b"data: [DONE]\n\n"


async def test_close_delimited_stream_without_content_ends_with_last_chunk(make_relay):
    async def script(up, index, reader, writer):
        await up.read_request(reader)
        # No length, no chunks: the body ends when the upstream closes.
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
            + ROLE
            + FINISH
            + DONE
        )
        await writer.drain()
        writer.close()

    up = await Scripted(script).start()
    try:
        app = await make_relay(up.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        resp = await httpc.exchange(reader, writer, "POST", CHAT, body, timeout=3)
        assert resp.header("transfer-encoding") == "chunked"
        assert resp.complete, resp.raw_body
        assert resp.body == ROLE + FINISH + DONE
        writer.close()
        [row] = await rows_of(app, 1)
        assert (row["status"], row["ok"], row["error_code"]) == (200, 1, None)
    finally:
        await up.stop()
