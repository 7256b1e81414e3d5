"""The openai SDK's Responses streaming helper, `client.responses.stream()`, fails on
llama-server's events, directly and through the relay alike; `responses.create(stream=True)`
reads them. llama-server's `response.output_text.delta` carries no `content_index` (nor
`output_index` or `sequence_number`: tests/support/captures/responses_stream.http), and the
helper indexes the message's content with it. Pinned against the simulator, which sends
llama-server's events, so that an SDK or server that changes this shows up here (and
docs/apis.md is then to be told)."""

from __future__ import annotations

import pytest

from tests.support.need import need_extra

openai = need_extra("test", "openai")


def client(base: str):
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=10)


async def created(base: str) -> tuple[list[str], str]:
    """(event types, text) of `responses.create(stream=True)`."""
    c = client(base)
    stream = await c.responses.create(
        model="tiny", input="Hi there", max_output_tokens=4, stream=True
    )
    kinds, text = [], ""
    async for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
    await c.close()
    return kinds, text


async def helper_fails(base: str) -> tuple[list[str], BaseException]:
    """The events `responses.stream()` yielded before it raised, and what it raised."""
    c = client(base)
    kinds: list[str] = []
    with pytest.raises(TypeError) as exc:
        async with c.responses.stream(model="tiny", input="Hi there", max_output_tokens=4) as s:
            async for ev in s:
                kinds.append(ev.type)
    await c.close()
    return kinds, exc.value


@pytest.mark.parametrize("via", ["relay", "direct"])
async def test_create_stream_works_and_the_stream_helper_fails_on_llama_servers_events(
    make_relay, sim, via
):
    base = sim.url if via == "direct" else f"http://127.0.0.1:{(await make_relay()).port}"
    kinds, text = await created(base)
    assert text == "Hello from a tiny"
    assert kinds[-1] == "response.completed" and kinds.count("response.output_text.delta") == 4
    before, err = await helper_fails(base)
    # It fails at the first text delta: the message's content indexed with None.
    assert before == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "NoneType" in str(err)
