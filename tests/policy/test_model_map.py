"""relay/policy/model_map.py: the model value is replaced and nothing else changes."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.policy import body_fields
from relay.policy.model_map import served_name, with_model


def model_spans(body: bytes) -> list[tuple[int, int]]:
    """The model member's span, as the relay finds it for a body it accepted."""
    spans = body_fields.locate(body, body_fields.read(body))
    return [spans["model"]] if "model" in spans else []


def test_plain_body():
    body = b'{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    assert with_model(body, "Qwen/Qwen2.5-7B-Instruct") == body.replace(
        b'"gpt-4o-mini"', b'"Qwen/Qwen2.5-7B-Instruct"'
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{ "model" : "a" , "x": 1 }',
        b'\n{\n\t"model":\r\n"a"\n}\n',
        b'{"messages":[{"model":"not me","content":"}{][\\"model\\":\\"x\\""}],"model":"a"}',
        b'{"model":"a\\"b\\\\","n":-1.5e3,"t":true,"f":null}',
        b'{"mod\\u0065l":"a"}',
        b'{"x":{"model":"nested"},"model":"a","y":[1,[2,{"model":"z"}]]}',
    ],
)
def test_only_the_top_level_model_value_changes(body):
    out = with_model(body, "B")
    [(start, end)] = model_spans(body)
    assert out == body[:start] + b'"B"' + body[end:]
    doc = json.loads(out)
    assert doc["model"] == "B"
    assert {k: v for k, v in doc.items() if k != "model"} == {
        k: v for k, v in json.loads(body).items() if k != "model"
    }


def test_new_name_is_escaped():
    assert (
        with_model(b'{"model":"a"}', 'we"ird\\na\u00efme')
        == b'{"model":' + msgspec.json.encode('we"ird\\na\u00efme') + b"}"
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"a","model":"b"}',
        b'{"model":"a","x":1,"model":"a"}',
        b'{"mo\\u0064el":"a","model":"b"}',
        b'{"model":null,"model":"b"}',
        b'{"model":"b","m\\u006fdel":null}',
    ],
)
def test_a_model_named_twice_is_refused(body):
    # which one an upstream reads is its parser's choice: nothing is safe to route or rewrite
    with pytest.raises(body_fields.Ambiguous):
        model_spans(body)


def test_other_members_named_twice_leave_the_model_alone():
    body = b'{"x":1,"model":"a","x":2}'
    assert with_model(body, "c") == b'{"x":1,"model":"c","x":2}'


def test_a_large_body_is_walked_member_by_member():
    import time

    messages = [{"role": "user", "content": "x"}] * 200_000  # ~6 MB of small strings
    body = json.dumps({"messages": messages, "model": "a"}).encode()
    t0 = time.process_time()
    assert with_model(body, "b") == body[:-4] + b'"b"}'
    assert time.process_time() - t0 < 0.5  # msgspec walks the nested values, in C


@pytest.mark.parametrize(
    "body", [b'{"stream":true}', b'{"model":null}', b'{"model":3}', b"{}", b'{"a":{"model":"x"}}']
)
def test_nothing_to_rewrite_leaves_the_body(body):
    assert with_model(body, "x") == body


def test_served_name():
    m = {"gpt-4o-mini": "Qwen/Qwen2.5-7B-Instruct", "same": "same", "*": "fallback-model"}
    assert served_name(m, "gpt-4o-mini") == "Qwen/Qwen2.5-7B-Instruct"
    assert served_name(m, "same") is None  # names agree: no rewrite
    assert served_name(m, "other") == "fallback-model"
    assert served_name({}, "x") is None and served_name(m, None) is None
    assert served_name({"a": "b"}, "c") is None


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(
    doc=st.dictionaries(st.text(max_size=6), _json, max_size=4),
    model=st.text(max_size=10),
    name=st.text(max_size=10),
    indent=st.sampled_from([None, 1, "\t"]),
    ascii_only=st.booleans(),
)
def test_random_documents(doc, model, name, indent, ascii_only):
    doc = {**doc, "model": model}
    body = json.dumps(doc, indent=indent, ensure_ascii=ascii_only).encode()
    out = with_model(body, name)
    assert json.loads(out) == {**doc, "model": name}
    [(start, end)] = model_spans(body)
    assert out == body[:start] + msgspec.json.encode(name) + body[end:]
