"""The official SDKs against the simulator's /v1/messages and /v1/responses: what they parse
out of its streams and bodies (text, tool calls, usage, stop reasons), as they do from the
pinned llama-server's (checked by hand against it: see tests/support/captures/README.md)."""

from __future__ import annotations

from tests.support.need import need_extra

anthropic = need_extra("test", "anthropic")
openai = need_extra("test", "openai")

HI = [{"role": "user", "content": "Hi there"}]
TEXT8 = "Hello from a tiny llama. Hello from"
A_TOOL = {
    "name": "get_weather",
    "description": "Get the weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
R_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def a_client(sim):
    return anthropic.AsyncAnthropic(base_url=sim.url, api_key="x", max_retries=0, timeout=10)


def o_client(sim):
    return openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0, timeout=10)


async def test_anthropic_stream_text(sim):
    client = a_client(sim)
    async with client.messages.stream(model="tiny", max_tokens=8, messages=HI) as s:
        kinds = [ev.type async for ev in s]
        msg = await s.get_final_message()
    await client.close()
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta", "text"] * 8,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == TEXT8
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (2, 8)
    assert msg.usage.cache_read_input_tokens == 0


async def test_anthropic_stream_tool_use(sim):
    client = a_client(sim)
    async with client.messages.stream(
        model="tiny",
        max_tokens=64,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[A_TOOL],
        extra_body={"sim": {"tool_call": True, "tokens": 3}},
    ) as s:
        kinds = [ev.type async for ev in s]
        msg = await s.get_final_message()
    await client.close()
    assert kinds.count("input_json") == 5
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Hello from a"
    tool = msg.content[1]
    assert tool.name == "get_weather" and tool.input == {"city": "Paris"} and len(tool.id) == 32
    assert msg.stop_reason == "tool_use" and msg.usage.output_tokens == 3 + 5


async def test_anthropic_create_and_count_tokens(sim):
    client = a_client(sim)
    msg = await client.messages.create(
        model="tiny", max_tokens=8, messages=HI, stop_sequences=["tiny"]
    )
    assert msg.content[0].text == "Hello from a" and msg.stop_reason == "end_turn"
    assert msg.stop_sequence == "tiny" and msg.usage.output_tokens == 4
    assert msg.id.startswith("chatcmpl-") and msg.model == "models/tiny.gguf"
    count = await client.messages.count_tokens(model="tiny", messages=HI)
    assert count.input_tokens == 2
    call = await client.messages.create(
        model="tiny",
        max_tokens=8,
        messages=HI,
        tools=[A_TOOL],
        extra_body={"sim": {"tool_call": True}},
    )
    await client.close()
    assert [b.type for b in call.content] == ["tool_use"] and call.content[0].input == {
        "city": "Paris"
    }


async def test_openai_responses_create_stream(sim):
    client = o_client(sim)
    stream = await client.responses.create(
        model="tiny", input="Hi there", max_output_tokens=4, stream=True
    )
    evs = [ev async for ev in stream]
    await client.close()
    assert [ev.type for ev in evs] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(ev.delta for ev in evs if ev.type == "response.output_text.delta")
    assert text == "Hello from a tiny" == evs[-1].response.output_text
    # llama-server's events have no sequence_number, output_index nor content_index
    assert {getattr(ev, "sequence_number", None) for ev in evs} == {None}
    usage = evs[-1].response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (2, 4, 6)
    assert evs[-1].response.id == evs[0].response.id and evs[-1].response.status == "completed"


async def test_openai_responses_stream_function_call(sim):
    client = o_client(sim)
    async with client.responses.stream(
        model="tiny",
        input=[{"type": "message", "role": "user", "content": "Weather?"}],
        tools=[R_TOOL],
        extra_body={"sim": {"tool_call": True}},
    ) as s:
        kinds = [ev.type async for ev in s]
        final = await s.get_final_response()
    await client.close()
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * 5,
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == '{"city": "Paris"}' and call.call_id.startswith("call_")


async def test_openai_responses_create(sim):
    client = o_client(sim)
    r = await client.responses.create(
        model="tiny", input="Hi there", instructions="Be brief", max_output_tokens=6
    )
    await client.close()
    assert r.output_text == "Hello from a tiny llama." and r.status == "completed"
    assert r.id.startswith("resp_") and r.output[0].id.startswith("msg_")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (4, 6)
