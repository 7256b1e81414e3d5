"""relay/policy/body_fields.py: the deciding members located once, a name sent twice refused
in every spelling, the walk and the byte-level shortcut agreeing, rewrites in place."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.policy import body_fields as B


def spans(body: bytes) -> dict:
    return B.locate(body, B.read(body))


def escaped(name: str, at: int, upper: bool = False) -> str:
    """`name` with its character at `at` as a \\u escape."""
    code = f"\\u{ord(name[at]):04x}"
    return name[:at] + (code.upper().replace("\\U", "\\u") if upper else code) + name[at + 1 :]


@pytest.mark.parametrize("name", B.DECIDING)
def test_every_deciding_name_twice_in_every_spelling_is_ambiguous(name):
    for first in (name, escaped(name, 0), escaped(name, len(name) - 1, upper=True)):
        for value in (b"null", b'"x"', b"1", b"[1]", b"{}"):
            for body in (
                b'{"%s":%s,"%s":1}' % (first.encode(), value, name.encode()),
                b'{"%s":1 ,\n "a":[{"%s":1}], "%s" : %s}'
                % (name.encode(), name.encode(), first.encode(), value),
            ):
                with pytest.raises(B.Ambiguous) as exc:
                    spans(body)
                assert exc.value.name == name


@pytest.mark.parametrize(
    "body,want",
    [
        (b'{"model":"a"}', {"model": b'"a"'}),
        (b'{ "model" :\t"a" , "n" : 2 }', {"model": b'"a"', "n": b"2"}),
        (b'{"x":{"model":"b"},"model":"a","y":["model"]}', {"model": b'"a"'}),
        (b'{"mod\\u0065l":"a","note":"\\u0041"}', {"model": b'"a"'}),
        (
            b'{"prompt":[1, [2, {"prompt":3}]] , "stream":true}',
            {"prompt": b'[1, [2, {"prompt":3}]]', "stream": b"true"},
        ),
        (b'{"model":null,"MODEL":"x","models":"y"}', {"model": b"null"}),
        (b'{"a":"\\"model\\":1","model":"q"}', {"model": b'"q"'}),
        (b"{}", {}),
        (b'{"other":1,"other":2}', {}),  # only the members the relay reads must be single
    ],
)
def test_spans_of_the_top_level_members(body, want):
    got = spans(body)
    assert {k: body[s:e] for k, (s, e) in got.items()} == want
    assert got == B.walk(body)  # the shortcut and the walk agree


def test_the_walk_is_bounded_when_a_name_may_repeat():
    many = b",".join(b'"%x":0' % i for i in range(B.MAX_MEMBERS + 1))
    # no name repeats: the bytes say so, nothing is walked
    assert spans(b'{"model":"a",' + many + b"}") == {"model": (9, 12)}
    # a nested `model`: the walk is needed, and stops at MAX_MEMBERS
    with pytest.raises(B.TooManyMembers):
        spans(b'{"model":"a","x":{"model":1},' + many + b"}")
    few = b",".join(b'"%x":0' % i for i in range(B.MAX_MEMBERS - 3))
    assert spans(b'{"model":"a","x":{"model":1},' + few + b"}") == {"model": (9, 12)}


def test_value_end_skips_every_kind_of_value():
    body = b'{"a":[1,{"b":"]}"}] ,"c":{"d":[]}\n,"e":"x\\"y","f":-1.5e3,"g":true}'
    i = body.index(b"[")
    assert body[i : B.value_end(body, i)] == b'[1,{"b":"]}"}]'
    i = body.index(b'{"d"')
    assert body[i : B.value_end(body, i)] == b'{"d":[]}'
    i = body.index(b'"x')
    assert body[i : B.value_end(body, i)] == b'"x\\"y"'
    i = body.index(b"-1")
    assert body[i : B.value_end(body, i)] == b"-1.5e3"


def test_splice_replaces_in_place_and_appends_before_the_brace():
    body = b'{ "max_tokens" : -1, "model":"a", "x":[{"model":1}] \n}'
    out, where = B.splice(
        body, spans(body), {"max_tokens": b"64", "model": b'"bb"', "n_predict": b"64"}
    )
    assert out == b'{ "max_tokens" : 64, "model":"bb", "x":[{"model":1}],"n_predict":64 \n}'
    assert {k: out[s:e] for k, (s, e) in where.items()} == {
        "max_tokens": b"64",
        "model": b'"bb"',
        "n_predict": b"64",
    }
    assert where == spans(out)
    assert B.splice(b"{}", {}, {"max_tokens": b"1"})[0] == b'{"max_tokens":1}'
    for bad in (b"", b"}", b"[1]", b'{"a":1'):
        with pytest.raises(msgspec.DecodeError):
            B.splice(bad, {}, {"max_tokens": b"1"})


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from([*B.DECIDING, "x", "y"]), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    doc=st.dictionaries(st.sampled_from([*B.DECIDING, "x", "y", "z"]), _json, max_size=6),
    indent=st.sampled_from([None, 1]),
    escape=st.booleans(),
)
def test_random_documents(doc, indent, escape):
    text = json.dumps(doc, indent=indent)
    if escape:  # an escaped letter somewhere (a value's or a name's): the walk decides
        text = text.replace("x", "\\u0078")
    body = text.encode()
    got = spans(body)
    assert got == B.walk(body)
    assert {k: json.loads(body[s:e]) for k, (s, e) in got.items()} == {
        k: v for k, v in doc.items() if k in B.DECIDING
    }
