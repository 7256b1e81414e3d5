"""The pure admission rules: framing of a head, the body peek, token limits, head-time auth."""

import json

import pytest

from relay.config import KeyConfig
from relay.errors import RelayError
from relay.http import request_framing as reqhead
from relay.policy import admission as A
from relay.policy.keys import Auth
from relay.proxy.body_memory import BodyBytes

H = [(b"Host", b"a")]


@pytest.mark.parametrize(
    "headers,http11,code",
    [
        (H, True, None),
        (H + [(b"Content-Length", b"5")], True, None),
        (H + [(b"Transfer-Encoding", b"chunked")], True, None),
        (H + [(b"transfer-encoding", b"Chunked ")], True, None),
        (H + [(b"Content-Length", b"5"), (b"Transfer-Encoding", b"chunked")], True, "bad_request"),
        (H + [(b"Transfer-Encoding", b"chunked")], False, "bad_request"),
        (H + [(b"Transfer-Encoding", b"gzip, chunked")], True, "not_implemented"),
        (
            H + [(b"Transfer-Encoding", b"chunked"), (b"Transfer-Encoding", b"chunked")],
            True,
            "not_implemented",
        ),
        (H + [(b"Transfer-Encoding", b"identity")], True, "not_implemented"),
        (H + [(b"Content-Length", b"5"), (b"Content-Length", b"6")], True, "bad_request"),
        (H + [(b"Content-Length", b"5, 5")], True, None),
        (H + [(b"Content-Length", b"+5")], True, "bad_request"),
    ],
)
def test_framing_error(headers, http11, code):
    err = reqhead.framing_error(headers, http11)
    assert (err.code if err else None) == code


@pytest.mark.parametrize(
    "head,folded",
    [
        (b"POST / HTTP/1.1\r\nHost: a\r\n\r\n", False),
        (b"\r\n\r\nPOST / HTTP/1.1\r\nHost: a\r\n\r\n", False),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding:\r\n chunked\r\n\r\n", True),
        (b"POST / HTTP/1.1\nX: a\n\tb\n\n", True),
        (b"POST / HTTP/1.1\r\nHost: a\r\n\r\n\r\n body line", False),  # after the head: body
    ],
)
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


CHAT = "/v1/chat/completions"


def peek(**fields) -> A.Peek:
    return A.peek_body(b"POST", [], json.dumps(fields).encode(), True)


@pytest.mark.parametrize(
    "fields,limit",
    [
        ({}, None),
        ({"max_tokens": -1}, None),
        ({"max_tokens": 5, "n_predict": -1}, None),
        ({"max_tokens": 1, "n_predict": 3000}, 3000),
        ({"max_completion_tokens": 7}, 7),
        ({"max_output_tokens": 9, "max_tokens": 2}, 2),
        ({"n_predict": 0}, 0),
    ],
)
def test_completion_limit_is_the_largest_field_or_unbounded(fields, limit):
    assert A.completion_limit(peek(**fields), CHAT) == limit
    assert A.estimate_tokens(b"x" * 40, peek(**fields), 77, CHAT) == (
        10,
        77 if limit is None else limit,
    )


@pytest.mark.parametrize(
    "path,fields,limit",
    [
        # a field another API names is ignored by llama-server on this path: unbounded
        (CHAT, {"max_output_tokens": 5}, None),
        ("/v1/completions", {"max_output_tokens": 5}, None),
        ("/completion", {"max_completion_tokens": 5}, None),
        ("/completion", {"max_tokens": 5}, 5),
        ("/infill", {"n_predict": 6}, 6),
        # llama-server's Responses route reads all four (n_predict first): the largest
        ("/v1/responses", {"max_tokens": 5}, 5),
        ("/v1/responses", {"max_output_tokens": 3, "n_predict": 12}, 12),
        ("/v1/responses", {"max_output_tokens": 3, "max_completion_tokens": 1500}, 1500),
        ("/v1/responses", {"max_output_tokens": 3, "n_predict": -1}, None),
        ("/responses", {"max_output_tokens": 5}, 5),
        ("/v1/messages", {"max_tokens": 7, "n_predict": 3}, 7),
        ("/v1/messages", {"max_output_tokens": 7}, None),
        ("/v1/embeddings", {"max_tokens": 7}, 0),
        ("/v1/rerank", {}, 0),
        ("/some/new/route", {"max_tokens": 7}, None),
    ],
)
def test_completion_limit_reads_only_the_fields_the_path_honours(path, fields, limit):
    assert A.completion_limit(peek(**fields), path) == limit


@pytest.mark.parametrize(
    "prompt,count",
    [
        ("one", 1),
        ([1, 2, 3], 1),
        ([12, "mixed", 34], 1),
        (["a", "b", "c"], 3),
        ([[1, 2], [3, 4]], 2),
        (["a", [1, 2]], 2),
        ([{"prompt_string": "a"}, "b"], 2),
        ([], 1),
        (None, 1),
    ],
)
def test_prompt_count(prompt, count):
    assert A.prompt_count(peek(prompt=prompt)) == count


def test_reservation_multiplies_limit_prompts_and_choices():
    p = peek(prompt=["a", "b", "c"], max_tokens=10, n=2)
    assert A.estimate_tokens(b"", p, 77, "/v1/completions") == (0, 60)
    assert A.estimate_tokens(b"", peek(prompt=["a", "b"]), 77, "/completion") == (0, 154)
    for n in (0, -3, None, "1", 1.0):
        assert A.choices(peek(n=n)) == 1
    assert A.estimate_tokens(b"", peek(max_tokens=10, n=4), 77, CHAT) == (0, 40)


@pytest.mark.parametrize(
    "fields,choices",
    [
        # every spelling vLLM / pydantic read as 4 is reserved as 4 completions
        ({"n": 4}, 4),
        ({"n": "4"}, 4),
        ({"n": " 4 "}, 4),
        ({"n": 4.0}, 4),
        ({"n": "4.0"}, 4),
        ({"n": 4e0}, 4),
        # legacy completions: best_of completions are generated, n returned
        ({"best_of": 4}, 4),
        ({"best_of": 4, "n": 2}, 4),
        ({"best_of": "3", "n": 5}, 5),
        ({"n": 10**12}, A.MAX_CHOICES),
        ({"n": 10**400}, A.MAX_CHOICES),
        # llama-server's own count of choices
        ({"n_cmpl": 4}, 4),
        ({"n_cmpl": 2, "n": 3}, 3),
    ],
)
def test_choices_read_as_the_servers_read_them(fields, choices):
    assert A.choices(peek(max_tokens=300, **fields)) == choices
    assert A.estimate_tokens(b"", peek(max_tokens=300, **fields), 77, CHAT)[1] == 300 * choices


@pytest.mark.parametrize(
    "fields",
    [
        {"n": "x"},
        {"n": 1.5},
        {"n": "2.5"},
        {"n": True},
        {"n": [4]},
        {"best_of": {"a": 4}},
        {"n": "inf"},
        {"n": "nan"},
        {"n": "4_0"},
        {"n_cmpl": "two"},
    ],
)
def test_choices_no_server_reads_as_a_count_are_refused(fields):
    with pytest.raises(RelayError) as exc:
        peek(**fields)
    assert exc.value.code == "bad_request" and exc.value.status == 400


@pytest.mark.parametrize("raw", [b"1e400", b"-1e400", b"1e309"])
def test_a_count_out_of_any_range_is_a_400_not_a_crash(raw):
    with pytest.raises(RelayError) as exc:
        A.peek_body(b"POST", [], b'{"max_tokens":3,"n":' + raw + b"}", True)
    assert exc.value.code == "bad_request" and exc.value.status == 400


@pytest.mark.parametrize(
    "path,body,want",
    [
        # the fields of the path the request carries: every one of them is capped
        (
            CHAT,
            b'{"model":"m","max_tokens":-1,"n_predict":7}',
            b'{"model":"m","max_tokens":64,"n_predict":64}',
        ),
        # replaced where they were sent, whatever surrounds them
        (
            CHAT,
            b'{"max_tokens" :\n -1 , "a":[{"max_tokens":1}], "n_predict": -5}',
            b'{"max_tokens" :\n 64 , "a":[{"max_tokens":1}], "n_predict": 64}',
        ),
        (CHAT, b'{"max_tokens":null}', b'{"max_tokens":64}'),
        # a field of another API is left alone, the path's own field added
        (CHAT, b'{"max_output_tokens":5}', b'{"max_output_tokens":5,"max_tokens":64}'),
        ("/v1/responses", b'{"input":"x"}', b'{"input":"x","max_output_tokens":64}'),
        (
            "/v1/responses",
            b'{"max_output_tokens":3,"n_predict":-1}',
            b'{"max_output_tokens":64,"n_predict":64}',
        ),
        ("/v1/messages", b'{"messages":[]}', b'{"messages":[],"max_tokens":64}'),
        ("/completion", b'{"prompt":"}"}', b'{"prompt":"}","n_predict":64}'),
        # whitespace, an empty object, nested objects, strings holding braces
        (CHAT, b"{}", b'{"max_tokens":64}'),
        (CHAT, b" { \n } \r\n", b' {"max_tokens":64 \n } \r\n'),
        (CHAT, b'{"a":{"b":{}}}  \n', b'{"a":{"b":{}},"max_tokens":64}  \n'),
        (CHAT, b'{"a":"{}}{"}', b'{"a":"{}}{","max_tokens":64}'),
        (CHAT, b'{"a":[{"}":"{"}] }', b'{"a":[{"}":"{"}],"max_tokens":64 }'),
    ],
)
def test_with_limit_splices_the_fields_the_api_reads(path, body, want):
    out = A.with_limit(body, A.peek_body(b"POST", [], body, True), 64, path)
    assert out == want
    # each field named once: what the relay reserved on is what any parser reads
    again = A.peek_body(b"POST", [], out, True)
    assert A.completion_limit(again, path) == 64
    assert {k: v for k, v in json.loads(body).items() if k not in A.LIMIT_FIELDS} == {
        k: v for k, v in json.loads(out).items() if k not in A.LIMIT_FIELDS
    }


def test_splice_refuses_what_is_not_an_object():
    for bad in (b"", b"}", b"  }", b"[1]", b'{"a":1'):
        with pytest.raises(RelayError):
            A.with_limit(bad, A.Peek(), 1, CHAT)


def test_with_limit_does_not_decode_the_body():
    body = b'{"prompt":"' + b"x" * (8 << 20) + b'"}'
    p = A.peek_body(b"POST", [], body, True)
    import time

    t = time.perf_counter()
    out = A.with_limit(body, p, 16, "/completion")
    assert time.perf_counter() - t < 0.2
    assert out.endswith(b'","n_predict":16}') and len(out) == len(body) + len(b',"n_predict":16')


def test_generates_every_post_but_the_cheap_routes():
    for path in (
        CHAT,
        "/v1/messages",
        "/responses",
        "/v1/responses",
        "/v1/rerank",
        "/reranking",
        "/v1/audio/transcriptions",
        "/predict",
        "/some/route/added/later",
    ):
        assert A.generates(b"POST", path), path
    for path in (
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/v1/messages/count_tokens",
        "/v1/responses/input_tokens",
        "/props",
        "/health",
        "/slots",
        "/slots/0",
        "/lora-adapters",
        "/models/load",
        "/models/unload",
    ):
        assert not A.generates(b"POST", path), path
    assert not A.generates(b"GET", CHAT)
    assert A.json_route("/v1/messages") and not A.json_route("/v1/audio/transcriptions")


def test_head_check():
    import hashlib

    auth = Auth(
        [KeyConfig(id="k", sha256=hashlib.sha256(b"s").hexdigest())],
        hashlib.sha256(b"adm").hexdigest(),
    )
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


def test_the_health_check_asks_for_no_key():
    """GET/HEAD /health and /v1/health, as llama-server: no key, and one sent anyway (even a
    wrong one) is not looked at; any other method or path asks as before."""
    import hashlib

    auth = Auth(
        [KeyConfig(id="k", sha256=hashlib.sha256(b"s").hexdigest())],
        hashlib.sha256(b"adm").hexdigest(),
    )
    far = "192.0.2.2"
    for method in (b"GET", b"HEAD"):
        for path in ("/health", "/v1/health"):
            assert A.is_health(method, path)
            for sent in ([], [(b"Authorization", b"Bearer s")], [(b"Authorization", b"Bearer x")]):
                assert A.head_check(auth, method, path, sent, far) == (None, None), (method, path)
    for method, path in ((b"POST", "/health"), (b"GET", "/healthz"), (b"GET", "/v1/healthz")):
        assert not A.is_health(method, path)
        assert A.head_check(auth, method, path, [], far)[1].status == 401, (method, path)


def test_body_bytes_bound():
    b = BodyBytes(10)
    assert b.take(6) and not b.take(5) and b.held == 6
    b.give(6)
    assert b.take(10) and b.held == 10


def test_prompt_lists_are_counted_up_to_max_prompts():
    many = ["p"] * A.MAX_PROMPTS
    assert A.prompt_count(peek(prompt=many)) == A.MAX_PROMPTS
    assert A.prompt_count(peek(prompt=[[1, 2]] * 3 + [{"prompt_string": "x"}])) == 4
    for over in (many + ["p"], [[1]] * (A.MAX_PROMPTS + 5)):
        assert A.prompt_count(peek(prompt=over)) == A.MAX_PROMPTS + 1  # at least
    # a flat list of token ids is one prompt, however long
    assert A.prompt_count(peek(prompt=list(range(A.MAX_PROMPTS * 3)))) == 1
