"""The drain's last step cancels a request whose response is whole and written while it
waits for the client to read it: the row says what the exchange came to (done, ok), and the
upstream connection is closed, not left open."""

from __future__ import annotations

import asyncio

from tests.support import httpc
from tests.support.fakeup import Scripted
from tests.support.helpers import wait_for

DOC = (
    b'{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}'
)


async def test_drain_cancel_while_waiting_for_the_client_to_read(make_relay, monkeypatch):
    entered = asyncio.Event()

    async def slow_drained(self, timeout):
        entered.set()
        await asyncio.sleep(60)

    from relay.proxy.client_writer import ClientWriter

    monkeypatch.setattr(ClientWriter, "drained", slow_drained)

    async def script(up, index, reader, writer):
        await up.read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(DOC), DOC)
        )
        await writer.drain()
        await reader.read()

    up = await Scripted(script).start()
    try:
        app = await make_relay(up.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        resp = await httpc.exchange(reader, writer, "POST", "/v1/chat/completions", body)
        assert resp.status == 200
        await asyncio.wait_for(entered.wait(), 5)
        stop = asyncio.ensure_future(app.stop(drain_timeout_s=0.1))
        await asyncio.sleep(0.05)
        app.hurry()
        await asyncio.wait_for(stop, 10)
        [line] = app.log.of("access")
        # the client got the whole response
        assert (line["outcome"], line["ok"]) == ("done", True)
        # the upstream connection is not left open
        await wait_for(lambda: len(up.closed_at) == 1, timeout=2)
        writer.close()
    finally:
        await up.stop()
