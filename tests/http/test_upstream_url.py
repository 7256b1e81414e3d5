"""Unit tests for relay/http/upstream_url.py: URL -> address, Host header, path prefix joining."""

from __future__ import annotations

import posixpath
from urllib.parse import unquote_to_bytes

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.http.request_path import normalize
from relay.http.upstream_url import TargetError, parse_target


@pytest.mark.parametrize(
    "url,scheme,host,port,host_header,prefix",
    [
        ("http://127.0.0.1:8081", "http", "127.0.0.1", 8081, b"127.0.0.1:8081", b""),
        ("http://llm", "http", "llm", 80, b"llm", b""),
        ("http://llm:443", "http", "llm", 443, b"llm:443", b""),
        ("https://api.example.com", "https", "api.example.com", 443, b"api.example.com", b""),
        ("https://api.example.com/", "https", "api.example.com", 443, b"api.example.com", b""),
        (
            "https://api.example.com:443/v1",
            "https",
            "api.example.com",
            443,
            b"api.example.com",
            b"/v1",
        ),
        ("https://h:8443/api/v1/", "https", "h", 8443, b"h:8443", b"/api/v1"),
        ("https://h:80", "https", "h", 80, b"h:80", b""),
        ("http://[::1]:9000/x", "http", "::1", 9000, b"[::1]:9000", b"/x"),
        ("https://[::1]", "https", "::1", 443, b"[::1]", b""),
    ],
)
def test_parse(url, scheme, host, port, host_header, prefix):
    t = parse_target(url)
    assert (t.scheme, t.host, t.port, t.host_header, t.prefix) == (
        scheme,
        host,
        port,
        host_header,
        prefix,
    )
    assert t.tls == (scheme == "https")


@pytest.mark.parametrize(
    "url",
    [
        "ftp://h",
        "https://",
        "http://h?x",
        "http://h/#x",
        "http://u@h",
        "http://h/a/./b",
        "http://h/a/../b",
        "http://h:0",
        "http://h/%2e%2e",
    ],
)
def test_parse_refuses(url):
    with pytest.raises(TargetError):
        parse_target(url)


@pytest.mark.parametrize(
    "prefix,client,sent",
    [
        # no prefix: the client's target unchanged, whatever it is
        ("", b"/v1/chat/completions", b"/v1/chat/completions"),
        ("", b"/x/../y?q=1", b"/x/../y?q=1"),
        # the OpenAI base-URL rule: a prefix ending in /v1 does not double /v1
        ("/v1", b"/v1/chat/completions", b"/v1/chat/completions"),
        ("/api/v1", b"/v1/chat/completions", b"/api/v1/chat/completions"),
        ("/api/v1", b"/v1/models?limit=5", b"/api/v1/models?limit=5"),
        ("/api/v1", b"/v1", b"/api/v1"),
        ("/api/v1", b"/v1?x=1", b"/api/v1?x=1"),
        # a client path without /v1 is put under the prefix as is
        ("/api/v1", b"/chat/completions", b"/api/v1/chat/completions"),
        ("/api/v1", b"/health", b"/api/v1/health"),
        ("/api/v1", b"/v10/x", b"/api/v1/v10/x"),  # "/v10" is not "/v1/"
        ("/api/v1", b"/v1beta/x", b"/api/v1/v1beta/x"),
        # a prefix not ending in /v1 keeps the client's /v1
        ("/llama", b"/v1/chat/completions", b"/llama/v1/chat/completions"),
        ("/openai/v1beta", b"/v1/chat/completions", b"/openai/v1beta/v1/chat/completions"),
        ("/api/v1", b"/", b"/api/v1/"),
        # absolute-form request target: its path part
        ("/api/v1", b"http://relay.test/v1/chat/completions", b"/api/v1/chat/completions"),
        # escaped characters pass as they came
        ("/api", b"/v1/chat/%63ompletions", b"/api/v1/chat/%63ompletions"),
    ],
)
def test_join(prefix, client, sent):
    t = parse_target("https://h" + prefix)
    assert t.join(client) == sent


@pytest.mark.parametrize(
    "client", [b"/../admin", b"/v1/../../admin", b"/v1/%2e%2e/x", b"/%2E%2E/x", b"/./x", b"*"]
)
def test_join_refuses_what_could_leave_the_prefix(client):
    t = parse_target("https://h/api/v1")
    with pytest.raises(TargetError):
        t.join(client)


# ---- issue 21 item 2: no client target, however encoded, leaves the prefix ---------------------
# Servers read a path differently: nginx and cpp-httplib percent-decode it once (nginx then
# resolves `..` made of `%2e` and `%2f`), uvicorn hands it on decoded, IIS and others read `\`
# (and `%5c`) as `/`, Tomcat and Jetty drop `;` parameters (`..;` is `..`), a chain of proxies
# may decode twice. Under a prefix, a target in which any of them could read a dot segment is
# refused (400 bad_request where the proxy answers it), whatever the rest of the path holds.
ESCAPES = [
    # one round of percent-decoding makes the dot segments, or the separators around them
    b"/v1/..%2f..%2fsecret",
    b"/v1/..%2F..%2Fsecret",
    b"/v1/%2e%2e%2f%2e%2e%2fsecret",
    b"/v1/%2E%2E%2F%2E%2E%2Fsecret",
    b"/v1/%2e%2E/%2E%2e/secret",
    b"/v1/.%2e/.%2e/secret",
    b"/v1/%2e./%2e./secret",
    b"/v1/x%2f..%2f..%2f..%2fsecret",
    b"/v1/models/%2e%2e",  # a trailing `..`, encoded
    b"/v1/models/..%2f",
    b"/v1/%2e",
    # a backslash, raw or encoded, is a separator to some servers
    b"/v1/..%5c..%5csecret",
    b"/v1/..%5C..%5Csecret",
    b"/v1/..\\..\\secret",
    b"/v1/models\\..\\..\\..\\secret",
    b"/v1/x\\%2e%2e\\%2e%2e\\secret",
    # decoded twice, three times
    b"/v1/%252e%252e/%252e%252e/secret",
    b"/v1/%252E%252E%252F%252E%252E%252Fsecret",
    b"/v1/..%252f..%252fsecret",
    b"/v1/%25252e%25252e/secret",
    b"/v1/..%255c..%255csecret",
    # `;` parameters and a NUL end the name a segment is read as
    b"/v1/..;/..;/secret",
    b"/v1/models/..;x=1/..;/..;/secret",
    b"/v1/%2e%2e;jsessionid=1/%2e%2e;/secret",
    b"/v1/.;/x",
    b"/v1/..%00/..%00/secret",
    # overlong UTF-8 forms of `.` and `/` (never valid UTF-8; old decoders read them)
    b"/v1/%c0%ae%c0%ae/%c0%ae%c0%ae/secret",
    b"/v1/..%c0%af..%c0%afsecret",
    b"/v1/%e0%80%ae%e0%80%ae%c1%9csecret",
    # raw dot segments, trailing ones included
    b"/v1/../../secret",
    b"/v1/models/..",
    b"/v1/models/.",
    # the query does not hide what comes before it; a `#` ends nothing here
    b"/v1/%2e%2e%2f%2e%2e%2fsecret?x=1",
    b"/v1/..%2f..%2fsecret#frag",
    b"/v1/x#/../../secret",
    # absolute-form, with an authority (empty or not, the scheme in any case) or without
    b"http://relayhost/v1/../../secret",
    b"http://relayhost/v1/..%2f..%2fsecret",
    b"HTTP://relayhost/v1/%2e%2e%2f%2e%2e%2fsecret",
    b"hTtPs://relayhost/v1/..\\..\\secret",
    b"http://relayhost/v1/%252e%252e/%252e%252e/secret",
    b"http:///v1/..%2f..%2fsecret",
    b"http:/v1/../../secret",
    b"http:..%2f..%2fsecret",
    b"relayhost/v1/../../secret",
    b"*",
    # still decoding after MAX_DECODES rounds: refused, whatever it would become
    b"/v1/%" + b"25" * 9 + b"41",
]


@pytest.mark.parametrize("client", ESCAPES)
def test_no_encoding_of_a_dot_segment_or_a_separator_leaves_the_prefix(client):
    t = parse_target("http://h:8080/api/v1")
    with pytest.raises(TargetError):
        t.join(client)


PASSES = [
    (b"/v1/chat/completions", b"/api/v1/chat/completions"),
    # an encoded slash that makes no dot segment: under the prefix, decoded or not (a model id
    # such as org/name in a path); nginx hands it on as /api/v1/models/org/name
    (b"/v1/models/org%2Fname", b"/api/v1/models/org%2Fname"),
    (b"/v1/models/org%2fname%2fv2", b"/api/v1/models/org%2fname%2fv2"),
    (b"/v1/a%5cb", b"/api/v1/a%5cb"),
    # dots that are not a whole segment
    (b"/v1/files/a.b.c", b"/api/v1/files/a.b.c"),
    (b"/v1/files/.hidden", b"/api/v1/files/.hidden"),
    (b"/v1/files/..x/x..", b"/api/v1/files/..x/x.."),
    (b"/v1/files/...", b"/api/v1/files/..."),
    (b"/v1/files/%2e%2e%2e", b"/api/v1/files/%2e%2e%2e"),
    # percent signs that decode to no dot, however often
    (b"/v1/100%25", b"/api/v1/100%25"),
    (b"/v1/a%2520b", b"/api/v1/a%2520b"),
    (b"/v1/%" + b"25" * 7 + b"41", b"/api/v1/%" + b"25" * 7 + b"41"),
    # anything in the query
    (b"/v1/models?name=../../secret", b"/api/v1/models?name=../../secret"),
    (b"/v1/x?p=%2e%2e%2f%2e%2e%2f&q=..\\..", b"/api/v1/x?p=%2e%2e%2f%2e%2e%2f&q=..\\.."),
    (b"/v1?..", b"/api/v1?.."),
    # parameters, fragments, repeated slashes: passed as they came
    (b"/v1/x;y=1", b"/api/v1/x;y=1"),
    (b"/v1/x#frag", b"/api/v1/x#frag"),
    (b"/v1//chat", b"/api/v1//chat"),
    # absolute-form: its path and query, the scheme in any case
    (b"http://relayhost/v1/models/org%2Fname", b"/api/v1/models/org%2Fname"),
    (b"HTTP://relayhost/v1/chat/completions", b"/api/v1/chat/completions"),
    (b"http://relayhost", b"/api/v1/"),
    (b"http://relayhost?x=../..", b"/api/v1/?x=../.."),
]


@pytest.mark.parametrize("client,sent", PASSES)
def test_what_names_no_dot_segment_passes_under_the_prefix(client, sent):
    assert parse_target("http://h:8080/api/v1").join(client) == sent


@pytest.mark.parametrize("prefix", ["/a/..;x", "/a/.;", "/a/../b"])
def test_a_prefix_is_held_to_the_same_dot_segment_rule(prefix):
    with pytest.raises(TargetError, match="plain segments"):
        parse_target("http://h" + prefix)


def _servers_view(path: bytes, decodes: int, params: bool) -> str:
    """What a server that decodes `decodes` times, reads `\\` as `/` and (`params`) drops `;`
    parameters resolves `path` to: an oracle written apart from relay.http.request_path."""
    for _ in range(decodes):
        path = unquote_to_bytes(path)
    text = path.decode("latin-1").replace("\\", "/")
    if params:
        text = "/".join(seg.split(";", 1)[0] for seg in text.split("/"))
    return posixpath.normpath("/" + text.lstrip("/"))  # (normpath keeps a leading "//")


PIECES = [b"/", b"\\", b".", b"..", b"%2e", b"%2E", b"%2f", b"%5c", b"%25", b"2e", b";", b"a"]


@settings(max_examples=3000, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.sampled_from([b"", b"?q=../.."]))
def test_a_joined_target_stays_under_the_prefix_for_every_server_reading(pieces, query):
    """Built from the pieces an escape is made of: whatever join lets through resolves under
    the prefix for a server decoding 0 to 3 times, with or without `\\` and `;` rules, and
    in the relay's own view (`normalize`) too."""
    t = parse_target("http://h/api/v1")
    client = b"/v1/" + b"".join(pieces) + query
    try:
        sent = t.join(client)
    except TargetError:
        return
    path = sent.split(b"?", 1)[0]
    for decodes in range(4):
        for params in (False, True):
            view = _servers_view(path, decodes, params)
            assert view == "/api/v1" or view.startswith("/api/v1/"), (client, decodes, view)
    assert normalize(sent) == "/api/v1" or normalize(sent).startswith("/api/v1/")
    # the relay's own view of the client's path had no dot segment to resolve either
    folded = unquote_to_bytes(client.split(b"?", 1)[0]).replace(b"\\", b"/").split(b"/")
    assert normalize(client) == "/" + "/".join(s.decode("latin-1") for s in folded if s)
