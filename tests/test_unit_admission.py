"""The pure admission rules: framing of a head, the body peek, token limits, head-time auth."""

import json

import msgspec
import pytest

from relay import admission as A
from relay import reqhead
from relay.auth import Auth
from relay.bodies import BodyBytes
from relay.config import KeyConfig
from relay.errors import RelayError

H = [(b"Host", b"a")]


@pytest.mark.parametrize("headers,http11,code", [
    (H, True, None),
    (H + [(b"Content-Length", b"5")], True, None),
    (H + [(b"Transfer-Encoding", b"chunked")], True, None),
    (H + [(b"transfer-encoding", b"Chunked ")], True, None),
    (H + [(b"Content-Length", b"5"), (b"Transfer-Encoding", b"chunked")], True, "bad_request"),
    (H + [(b"Transfer-Encoding", b"chunked")], False, "bad_request"),
    (H + [(b"Transfer-Encoding", b"gzip, chunked")], True, "not_implemented"),
    (H + [(b"Transfer-Encoding", b"chunked"), (b"Transfer-Encoding", b"chunked")], True,
     "not_implemented"),
    (H + [(b"Transfer-Encoding", b"identity")], True, "not_implemented"),
    (H + [(b"Content-Length", b"5"), (b"Content-Length", b"6")], True, "bad_request"),
    (H + [(b"Content-Length", b"5, 5")], True, None),
    (H + [(b"Content-Length", b"+5")], True, "bad_request"),
])
def test_framing_error(headers, http11, code):
    err = reqhead.framing_error(headers, http11)
    assert (err.code if err else None) == code


@pytest.mark.parametrize("head,folded", [
    (b"POST / HTTP/1.1\r\nHost: a\r\n\r\n", False),
    (b"\r\n\r\nPOST / HTTP/1.1\r\nHost: a\r\n\r\n", False),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding:\r\n chunked\r\n\r\n", True),
    (b"POST / HTTP/1.1\nX: a\n\tb\n\n", True),
    (b"POST / HTTP/1.1\r\nHost: a\r\n\r\n\r\n body line", False),  # after the head: body
])
def test_obs_fold(head, folded):
    assert reqhead.has_obs_fold(head) is folded


def test_peek_strict_on_llm_paths_whatever_the_content_type():
    text = [(b"Content-Type", b"text/plain")]
    assert A.peek_body(b"POST", text, b'{"model":"m","n_predict":5}', True).n_predict == 5
    for bad in (b"", b"[]", b"nope", b"1", b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"):
        with pytest.raises(RelayError) as exc:
            A.peek_body(b"POST", text, bad, True)
        assert exc.value.code == "invalid_json"
    with pytest.raises(RelayError) as exc:
        A.peek_body(b"POST", text, b'{"max_tokens":"x"}', True)
    assert exc.value.code == "bad_request"
    # elsewhere a body that is not JSON is simply not read
    assert A.peek_body(b"POST", text, b"nope", False) == A.Peek()
    assert A.peek_body(b"GET", text, b"nope", True) == A.Peek()


@pytest.mark.parametrize("fields,limit", [
    ({}, None), ({"max_tokens": -1}, None), ({"max_tokens": 5, "n_predict": -1}, None),
    ({"max_tokens": 1, "n_predict": 3000}, 3000), ({"max_completion_tokens": 7}, 7),
    ({"max_output_tokens": 9, "max_tokens": 2}, 9), ({"n_predict": 0}, 0),
])
def test_completion_limit_is_the_largest_field_or_unbounded(fields, limit):
    assert A.completion_limit(A.Peek(**fields)) == limit
    assert A.estimate_tokens(b"x" * 40, A.Peek(**fields), 77) == (10, 77 if limit is None else limit)


def test_with_limit_sets_the_fields_present_and_keeps_the_rest():
    body = (b'{"model":"m","max_tokens":-1,"n_predict":7,"x":[1.5,{"y":null}],'
            b'"big":123456789012345678901234}')
    doc = json.loads(A.with_limit(body, 64, "/v1/chat/completions"))
    assert doc == {"model": "m", "max_tokens": 64, "n_predict": 64, "x": [1.5, {"y": None}],
                   "big": 123456789012345678901234}
    assert A.completion_limit(msgspec.json.decode(A.with_limit(body, 64, "/v1/chat/completions"),
                                                  type=A.Peek)) == 64


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "max_tokens"),
                                        ("/v1/completions", "max_tokens"),
                                        ("/completion", "n_predict"),
                                        ("/v1/responses", "max_output_tokens")])
def test_with_limit_adds_only_the_field_the_api_reads(path, field):
    # a hosted API refuses fields it does not know: no n_predict sent to OpenAI's chat
    doc = json.loads(A.with_limit(b'{"model":"m","messages":[]}', 32, path))
    assert doc == {"model": "m", "messages": [], field: 32}


def test_head_check():
    import hashlib
    auth = Auth([KeyConfig(id="k", sha256=hashlib.sha256(b"s").hexdigest())],
                hashlib.sha256(b"adm").hexdigest())
    ok = [(b"Authorization", b"Bearer s")]
    lo, far = "127.0.0.1", "192.0.2.2"
    assert A.head_check(auth, b"POST", "/v1/chat/completions", ok, far) == ("k", None)
    assert A.head_check(auth, b"POST", "/v1/chat/completions", [], far)[1].status == 401
    assert A.head_check(auth, b"GET", "/metrics", ok, lo)[1].status == 401
    assert A.head_check(auth, b"GET", "/metrics", [(b"x-api-key", b"adm")], far) == (None, None)
    assert A.head_check(auth, b"POST", "/props", ok, lo)[1].status == 401  # an API key is no admin
    assert A.head_check(auth, b"POST", "/props", [(b"x-api-key", b"adm")], far) == (None, None)
    keys_only = Auth([KeyConfig(id="k", sha256=hashlib.sha256(b"s").hexdigest())], None)
    assert A.head_check(keys_only, b"POST", "/slots/0", ok, far)[1].status == 403
    assert A.head_check(keys_only, b"POST", "/slots/0", [], lo) == (None, None)
    open_auth = Auth([], None)
    assert A.head_check(open_auth, b"POST", "/v1/chat/completions", [], far) == (None, None)
    assert A.head_check(open_auth, b"POST", "/props", [], far) == (None, None)


def test_body_bytes_bound():
    b = BodyBytes(10)
    assert b.take(6) and not b.take(5) and b.held == 6
    b.give(6)
    assert b.take(10) and b.held == 10
