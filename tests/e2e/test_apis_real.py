"""Anthropic Messages and OpenAI Responses through the relay to a REAL llama-server (issue 22):
the official SDKs get the same text and usage as they do direct, and each row is exact with
the server's own figures."""

from __future__ import annotations

import pytest

from tests.support.helpers import rows_of
from tests.support.need import need_extra

pytestmark = pytest.mark.e2e

anthropic = need_extra("test", "anthropic")
openai = need_extra("test", "openai")

MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
async def relay(llama_server, make_relay):
    return await make_relay(url=llama_server.url, parallel=2)


def aclient(url: str):
    return anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0, timeout=30.0)


def oclient(url: str):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=30.0)


async def messages_turn(url: str):
    async with aclient(url).messages.stream(model="tiny", max_tokens=12, messages=MESSAGES) as s:
        deltas = [t async for t in s.text_stream]
        final = await s.get_final_message()
    return deltas, final


async def test_anthropic_sdk_through_the_relay_as_direct(llama_server, relay):
    direct, want = await messages_turn(llama_server.url)
    got, final = await messages_turn(f"http://127.0.0.1:{relay.port}")
    assert got == direct and final.content[0].text == want.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (want.stop_reason, 12)
    body = await aclient(f"http://127.0.0.1:{relay.port}").messages.create(
        model="tiny", max_tokens=5, messages=MESSAGES
    )
    s_row, n_row = await rows_of(relay, 2)
    u = final.usage
    prompt = (
        u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    )
    assert (s_row["tokens_source"], s_row["prompt_tokens"], s_row["completion_tokens"]) == (
        "exact",
        prompt,
        12,
    )
    assert s_row["ok"] == 1 and s_row["ttft_ms"] is not None and s_row["stream"] == 1
    assert (n_row["tokens_source"], n_row["completion_tokens"]) == (
        "exact",
        body.usage.output_tokens,
    )


async def responses_turn(url: str):
    stream = await oclient(url).responses.create(
        model="tiny", input="Hi there", max_output_tokens=6, stream=True
    )
    kinds, deltas, usage = [], [], None
    async for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type == "response.completed":
            usage = ev.response.usage
    return kinds, deltas, usage


async def test_openai_responses_through_the_relay_as_direct(llama_server, relay):
    want = await responses_turn(llama_server.url)
    kinds, deltas, usage = await responses_turn(f"http://127.0.0.1:{relay.port}")
    assert (kinds, deltas) == want[:2] and kinds[-1] == "response.completed"
    assert (usage.input_tokens, usage.output_tokens) == (want[2].input_tokens, 6)
    body = await oclient(f"http://127.0.0.1:{relay.port}").responses.create(
        model="tiny", input="Hi there", max_output_tokens=3
    )
    s_row, n_row = await rows_of(relay, 2)
    assert (s_row["tokens_source"], s_row["prompt_tokens"], s_row["completion_tokens"]) == (
        "exact",
        usage.input_tokens,
        6,
    )
    assert s_row["ok"] == 1 and s_row["ttft_ms"] is not None
    assert (n_row["tokens_source"], n_row["prompt_tokens"], n_row["completion_tokens"]) == (
        "exact",
        body.usage.input_tokens,
        body.usage.output_tokens,
    )


async def test_the_sdks_responses_stream_helper_fails_on_llama_server_as_through_the_relay(
    llama_server, relay
):
    """`client.responses.stream()` raises on llama-server's own events (no `content_index`
    on its text deltas), direct as through the relay; `create(stream=True)` reads them (the
    test above). docs/apis.md says so; tests/proxy/test_sdk_responses_stream.py pins the
    same against the simulator."""
    for url in (llama_server.url, f"http://127.0.0.1:{relay.port}"):
        kinds = []
        with pytest.raises(TypeError, match="NoneType"):
            async with oclient(url).responses.stream(
                model="tiny", input="Hi there", max_output_tokens=4
            ) as s:
                async for ev in s:
                    kinds.append(ev.type)
        assert kinds[-1] == "response.content_part.added", url
