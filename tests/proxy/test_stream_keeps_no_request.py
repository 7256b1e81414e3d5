"""An open stream keeps no request (its body: the whole prompt) once it was sent upstream:
the dispatcher drops it, and the exchange keeps only what the response needs."""

from __future__ import annotations

import gc

from relay.proxy.request import Request
from tests.support import httpc
from tests.support.helpers import wait_for
from tests.support.sockets import open_stream


async def test_a_streaming_request_keeps_no_request_body(make_relay, sim):
    app = await make_relay()
    chat = httpc.chat(12, interval_ms=40)
    chat["messages"][0]["content"] = "x" * 500_000
    _reader, writer, resp = await open_stream(app.port, chat)
    assert resp.status == 200
    client = next(iter(app.clients))
    await wait_for(lambda: client.exchange is not None and client.task is not None)
    await wait_for(lambda: [f.f_code.co_name for f in client.task.get_stack()] == ["handle"])
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, Request)]
    big = [r for r in alive if len(r.body) > 400_000]
    assert not big, [type(r).__name__ for r in gc.get_referrers(big[0])]
    writer.close()
