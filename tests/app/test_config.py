"""Unit tests for relay.config: defaults, unknown keys, ranges, cross-field rules, TOML."""

from __future__ import annotations

import pytest

from relay.config import Config, ConfigError, load_config, parse_config, parse_url

SHA = "ab" * 32
UP = {"name": "llm", "url": "http://127.0.0.1:8081"}


def test_defaults_match_design_table():
    cfg = parse_config({})
    assert isinstance(cfg, Config)
    s, d = cfg.server, cfg.dispatcher
    assert (s.host, s.port) == ("127.0.0.1", 8080)
    assert s.max_body_bytes == 8 * 1024 * 1024
    assert s.header_timeout_s == 10
    assert s.keepalive_timeout_s == 75
    assert d.connect_timeout_s == 5.0
    assert d.write_timeout_s == 10.0
    assert d.pool_timeout_s == 5.0
    assert d.direct_read_timeout_s == 300.0
    assert d.stream_total_timeout_s == 900.0
    assert d.stream_idle_timeout_s == 300.0
    assert cfg.store.path == "relay.db"
    assert cfg.upstream == [] and cfg.key == []  # no [[key]]: auth off
    assert cfg.admin_key_sha256 is None


def test_upstream_and_key_defaults():
    cfg = parse_config({"upstream": [UP], "key": [{"id": "k1", "sha256": SHA}]})
    [up] = cfg.upstream
    assert (up.name, up.url, up.models, up.parallel, up.queue, up.fallback) == (
        "llm",
        "http://127.0.0.1:8081",
        [],
        1,
        64,
        [],
    )
    assert (up.auth_header, up.auth_value_env) == (None, None)
    [k] = cfg.key
    assert (
        k.id,
        k.sha256,
        k.requests_per_day,
        k.tokens_per_day,
        k.requests_per_month,
        k.tokens_per_month,
    ) == ("k1", SHA, 0, 0, 0, 0)


def test_full_valid_config():
    cfg = parse_config(
        {
            "server": {"host": "0.0.0.0", "port": 9000, "max_body_bytes": 2048},
            "dispatcher": {
                "direct_read_timeout_s": 30,
                "stream_total_timeout_s": 0,
                "stream_idle_timeout_s": 86400,
            },
            "upstream": [
                {
                    "name": "a",
                    "url": "http://a:1",
                    "models": ["m"],
                    "parallel": 4,
                    "queue": 0,
                    "fallback": ["b"],
                    "auth_header": "Authorization",
                    "auth_value_env": "A_KEY",
                },
                {"name": "b", "url": "http://b"},
            ],
            "key": [{"id": "k", "sha256": SHA.upper(), "tokens_per_day": 1000}],
            "store": {"path": ":memory:"},
            "admin_key_sha256": SHA,
        }
    )
    assert cfg.dispatcher.direct_read_timeout_s == 30.0
    assert cfg.dispatcher.stream_total_timeout_s == 0.0
    assert cfg.upstream[0].fallback == ["b"] and cfg.upstream[0].parallel == 4
    assert cfg.key[0].tokens_per_day == 1000 and cfg.store.path == ":memory:"


@pytest.mark.parametrize(
    "data,where",
    [
        ({"server": {"bogus": 1}}, "server"),
        ({"dispatcher": {"bogus": 1}}, "dispatcher"),
        ({"store": {"bogus": 1}}, "store"),
        ({"upstream": [dict(UP, bogus=1)]}, 'upstream[0] (name "llm")'),
        ({"key": [{"id": "k", "sha256": SHA, "bogus": 1}]}, 'key[0] (id "k")'),
    ],
)
def test_unknown_keys_rejected(data, where):
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert str(exc.value) == f"{where}.bogus: unknown key"


def test_unknown_top_level_key_rejected():
    with pytest.raises(ConfigError, match=r"^bogus: unknown key$"):
        parse_config({"bogus": {}})


def test_unknown_key_message_names_dotted_path():
    with pytest.raises(ConfigError) as exc:
        parse_config({"server": {"bogus": 1}})
    assert "server.bogus" in str(exc.value)


@pytest.mark.parametrize(
    "section,key,value,msg",
    [
        ("dispatcher", "direct_read_timeout_s", 29, "Expected `float` >= 30.0"),
        ("dispatcher", "direct_read_timeout_s", 29.999, "Expected `float` >= 30.0"),
        ("dispatcher", "direct_read_timeout_s", 601, "Expected `float` <= 600.0"),
        ("dispatcher", "stream_idle_timeout_s", -1, "Expected `float` >= 0.0"),
        ("dispatcher", "stream_idle_timeout_s", 86401, "Expected `float` <= 86400.0"),
        ("dispatcher", "stream_total_timeout_s", -0.5, "Expected `float` >= 0.0"),
        ("dispatcher", "stream_total_timeout_s", 86400.5, "Expected `float` <= 86400.0"),
        ("server", "port", 65536, "Expected `int` <= 65535"),
        ("server", "port", -1, "Expected `int` >= 0"),
        ("server", "port", "8080", "Expected `int`, got `str`"),
    ],
)
def test_out_of_range_names_key_and_bound(section, key, value, msg):
    with pytest.raises(ConfigError) as exc:
        parse_config({section: {key: value}})
    assert str(exc.value) == f"{section}.{key}: {msg}"


@pytest.mark.parametrize(
    "section,key,value",
    [
        ("dispatcher", "direct_read_timeout_s", 30),
        ("dispatcher", "direct_read_timeout_s", 600),
        ("dispatcher", "stream_idle_timeout_s", 0),
        ("dispatcher", "stream_idle_timeout_s", 86400),
        ("dispatcher", "stream_total_timeout_s", 0),
        ("dispatcher", "stream_total_timeout_s", 86400),
    ],
)
def test_bounds_inclusive(section, key, value):
    assert getattr(getattr(parse_config({section: {key: value}}), section), key) == value


@pytest.mark.parametrize(
    "field", ["requests_per_day", "tokens_per_day", "requests_per_month", "tokens_per_month"]
)
def test_negative_budget_rejected(field):
    with pytest.raises(ConfigError) as exc:
        parse_config({"key": [{"id": "k", "sha256": SHA}, {"id": "j", "sha256": SHA, field: -1}]})
    assert str(exc.value) == f'key[1] (id "j").{field}: Expected `int` >= 0'


def test_bad_key_hash_and_admin_hash():
    with pytest.raises(ConfigError, match=r'^key\[0\] \(id "k"\)\.sha256: Expected `str` matching'):
        parse_config({"key": [{"id": "k", "sha256": "xyz"}]})
    with pytest.raises(ConfigError, match=r"^admin_key_sha256: "):
        parse_config({"admin_key_sha256": "a" * 63})


def test_missing_required_upstream_field():
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [{"name": "a"}]})
    assert str(exc.value) == 'upstream[0] (name "a").url: required, missing'


@pytest.mark.parametrize(
    "url",
    [
        "h:80",
        "http://",
        "http:///x",
        "ftp://h",
        "https://",
        "http://h?x=1",
        "https://h/v1?x=1",
        "http://h/v1#f",
        "http://u:p@h/v1",
        "https://key@h",
        "http://h/a/../v1",
        "http://h/a//v1",
        "http://h/a%2f",
        "http://h/a b",
        "http://h:notaport",
        "http://h:70000",
        "",
        "127.0.0.1:8081",
    ],
)
def test_bad_upstream_url(url):
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [{"name": "a", "url": url}]})
    assert str(exc.value).startswith('upstream[0] (name "a").url: ')


@pytest.mark.parametrize(
    "url,want",
    [
        ("http://127.0.0.1:8081", ("127.0.0.1", 8081)),
        ("http://llm", ("llm", 80)),
        ("http://llm/", ("llm", 80)),
        ("http://[::1]:9000", ("::1", 9000)),
        ("http://LLM.example:1", ("llm.example", 1)),
        ("https://api.example.com", ("api.example.com", 443)),
        ("https://api.example.com:8443/api/v1", ("api.example.com", 8443)),
        ("http://h:8080/v1/", ("h", 8080)),
    ],
)
def test_parse_url(url, want):
    assert parse_url(url) == want


def test_port_zero_url_rejected():
    with pytest.raises(ConfigError):
        parse_url("http://h:0")


def test_duplicate_upstream_names():
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [UP, dict(UP, url="http://other:1")]})
    assert str(exc.value) == 'upstream[1] (name "llm").name: not unique, upstream[0] has it too'


def test_duplicate_key_ids():
    with pytest.raises(ConfigError) as exc:
        parse_config({"key": [{"id": "k", "sha256": SHA}, {"id": "k", "sha256": SHA}]})
    assert str(exc.value) == 'key[1] (id "k").id: not unique, key[0] has it too'


@pytest.mark.parametrize("fallback", ["zzz", "llm"])  # unknown, and itself
def test_unknown_fallback(fallback):
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [dict(UP, fallback=[fallback])]})
    assert str(exc.value) == f'upstream[0] (name "llm").fallback: unknown upstream "{fallback}"'


@pytest.mark.parametrize("extra", [{"auth_header": "Authorization"}, {"auth_value_env": "LLM_KEY"}])
def test_auth_header_and_env_go_together(extra):
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [dict(UP, **extra)]})
    [given] = extra
    assert str(exc.value) == (
        f'upstream[0] (name "llm").{given}: auth_header and auth_value_env go together'
    )


def test_non_object_config():
    with pytest.raises(ConfigError, match="Expected `object`"):
        parse_config([])  # type: ignore[arg-type]


# ---- load_config ---------------------------------------------------------------------------
TOML = b"""
[server]
port = 9090

[dispatcher]
stream_idle_timeout_s = 60

[[upstream]]
name = "llm"
url = "http://127.0.0.1:8081"
models = ["tiny"]

[[upstream]]
name = "backup"
url = "http://127.0.0.1:8082"

[store]
path = ":memory:"
"""


def test_load_config_roundtrip(tmp_path):
    p = tmp_path / "relay.toml"
    p.write_bytes(TOML)
    data = load_config(str(p))
    assert data["server"] == {"port": 9090}
    cfg = parse_config(data)
    assert cfg.server.port == 9090 and cfg.server.host == "127.0.0.1"
    assert cfg.dispatcher.stream_idle_timeout_s == 60.0
    assert [u.name for u in cfg.upstream] == ["llm", "backup"]
    assert cfg.upstream[0].models == ["tiny"] and cfg.store.path == ":memory:"


def test_load_config_then_parse_rejects_unknown(tmp_path):
    p = tmp_path / "relay.toml"
    p.write_text("[server]\nbogus = 1\n")
    with pytest.raises(ConfigError, match=r"^server.bogus: unknown key$"):
        parse_config(load_config(str(p)))


def test_load_config_missing_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value) == f"{path}: cannot read: No such file or directory"


def test_load_config_directory(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(str(tmp_path))
    assert str(exc.value) == f"{tmp_path}: cannot read: Is a directory"


def test_load_config_invalid_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[server\nport = 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(str(p))
    assert str(exc.value).startswith(f"{p}: not TOML: ")


def test_load_config_invalid_utf8(tmp_path):
    p = tmp_path / "latin1.toml"
    p.write_bytes(b'[store]\npath = "caf\xe9.db"\n')
    with pytest.raises(ConfigError):
        load_config(str(p))


def test_drop_in_keys(tmp_path):
    """Issue 11's keys: heartbeat_s (default 15, 0 = off), cors_origins (off), model_map."""
    cfg = parse_config({"upstream": [UP]})
    assert cfg.dispatcher.heartbeat_s == 15.0
    assert cfg.server.cors_origins == [] and cfg.upstream[0].model_map == {}
    path = tmp_path / "relay.toml"
    path.write_text(
        '[server]\ncors_origins = ["*", "https://chat.example"]\n'
        "[dispatcher]\nheartbeat_s = 0\n"
        '[[upstream]]\nname = "llm"\nurl = "http://[::1]:8081"\n'
        'aliases = ["gpt-4o-mini"]\n'
        'model_map = { "gpt-4o-mini" = "Qwen/Qwen2.5-7B-Instruct", "*" = "qwen" }\n'
    )
    cfg = parse_config(load_config(str(path)))
    assert cfg.server.cors_origins == ["*", "https://chat.example"]
    assert cfg.dispatcher.heartbeat_s == 0
    assert cfg.upstream[0].model_map == {"gpt-4o-mini": "Qwen/Qwen2.5-7B-Instruct", "*": "qwen"}
    assert parse_url(cfg.upstream[0].url) == ("::1", 8081)
    for bad in (
        {"dispatcher": {"heartbeat_s": -1}},
        {"upstream": [{**UP, "model_map": {"a": ""}}]},
        {"server": {"cors_origins": [""]}},
    ):
        with pytest.raises(ConfigError):
            parse_config(bad)


# ---- issue 12: https upstreams, path prefixes, static headers --------------------------------
def test_tls_and_header_keys_defaults():
    [up] = parse_config({"upstream": [UP]}).upstream
    assert (up.verify, up.ca_file, up.headers, up.keepalive_s) == (True, None, {}, None)


def test_https_upstream_with_prefix_and_headers():
    [up] = parse_config(
        {
            "upstream": [
                {
                    "name": "remote",
                    "url": "https://api.example.com/v1",
                    "verify": True,
                    "ca_file": "/etc/ssl/private-ca.pem",
                    "keepalive_s": 120,
                    "headers": {"OpenAI-Organization": "org-x", "OpenAI-Project": "proj_1"},
                    "auth_header": "Authorization",
                    "auth_value_env": "REMOTE_KEY",
                }
            ]
        }
    ).upstream
    assert up.headers == {"OpenAI-Organization": "org-x", "OpenAI-Project": "proj_1"}
    assert up.keepalive_s == 120.0


@pytest.mark.parametrize("extra", [{"ca_file": "/x.pem"}, {"verify": False}])
def test_tls_keys_refused_on_plain_http(extra):
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [dict(UP, **extra)]})
    [key] = extra
    assert str(exc.value) == f'upstream[0] (name "llm").{key}: applies to https:// only'


def test_ca_file_with_verify_off_refused():
    with pytest.raises(ConfigError, match="verifies nothing"):
        parse_config(
            {"upstream": [{"name": "r", "url": "https://h", "verify": False, "ca_file": "/x.pem"}]}
        )


@pytest.mark.parametrize(
    "name",
    [
        "Authorization",
        "x-api-key",
        "API-Key",
        "Proxy-Authorization",
        "Cookie",
        "x-goog-api-key",
        "X-Auth-Token",
        "X-Secret",
        "X-Upstream-Auth",
    ],
)
def test_credential_like_static_header_refused(name):
    up = {"name": "r", "url": "https://h", "headers": {name: "sk-123"}}
    if name == "X-Upstream-Auth":
        up.update(auth_header="X-Upstream-Auth", auth_value_env="R_KEY")
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [up]})
    msg = str(exc.value)
    assert msg.startswith(f'upstream[0] (name "r").headers: {name!r} looks like a credential')
    assert "environment" in msg and "sk-123" not in msg  # the value is never echoed


@pytest.mark.parametrize(
    "headers,why",
    [
        ({"Host": "x"}, "is set by the relay"),
        ({"Content-Length": "1"}, "is set by the relay"),
        ({"Connection": "close"}, "is set by the relay"),
        ({"Bad Name": "x"}, "not a header name"),
        ({"Accept-Encoding": "gzip"}, "is set by the relay"),
        ({"X-Ok": "a\r\nX-Injected: 1"}, "control characters"),
    ],
)
def test_bad_static_header_refused(headers, why):
    with pytest.raises(ConfigError, match=why):
        parse_config({"upstream": [{"name": "r", "url": "https://h", "headers": headers}]})


def test_buffered_body_bound_below_the_body_limit_refused():
    data = {
        "server": {"max_body_bytes": 1 << 20, "max_buffered_body_bytes": 1 << 19},
        "upstream": [{"name": "a", "url": "http://127.0.0.1:9"}],
    }
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert "server.max_buffered_body_bytes" in str(err.value)
    assert "server.max_body_bytes" in str(err.value)
    data["server"]["max_buffered_body_bytes"] = 1 << 20  # equal: allowed
    assert parse_config(data).server.max_buffered_body_bytes == 1 << 20


# ---- issue 21 item 4: no header line injected from the configuration ---------------------------
# auth_header (the file) and the value of auth_value_env (the environment) are held to the
# rule static headers are held to (`http.to_upstream.check_header_name` / `_value`); a refusal
# names the key and quotes neither (the value is a secret, and a name may be one by mistake).
@pytest.mark.parametrize(
    "name,why",
    [
        ("X-Key\r\nX-Evil: 1", "not a header name"),
        ("X-Key\n", "not a header name"),  # (a `$` in a pattern lets a final LF through)
        ("X-Key\r", "not a header name"),
        ("X Key", "not a header name"),
        ("X-Key:", "not a header name"),
        ("X-K\u00e9y", "not a header name"),
        ("", "not a header name"),
        ("Content-Length", "set by the relay"),
        ("transfer-encoding", "set by the relay"),
        ("Host", "set by the relay"),
        ("X-Request-Id", "set by the relay"),
    ],
)
def test_an_auth_header_that_is_no_header_name_is_refused(name, why):
    up = {"name": "llm", "url": "https://h", "auth_header": name, "auth_value_env": "K"}
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [up]})
    msg = str(exc.value)
    assert msg.startswith('upstream[0] (name "llm").auth_header: ') and why in msg
    assert "X-Evil" not in msg and "Key" not in msg  # nothing of the name is quoted


@pytest.mark.parametrize("name", ["Authorization", "x-api-key", "X-Goog-Api-Key", "api-key"])
def test_an_auth_header_that_is_a_token_passes(name):
    up = {"name": "llm", "url": "https://h", "auth_header": name, "auth_value_env": "K"}
    assert parse_config({"upstream": [up]}).upstream[0].auth_header == name


@pytest.mark.parametrize(
    "headers,why",
    [
        ({"X-Ok": "x\n"}, "control characters"),  # a final LF: the line ends, the head too
        ({"X-Ok": "x\r"}, "control characters"),
        ({"X-Ok\n": "x"}, "not a header name"),
    ],
)
def test_a_static_header_ending_in_a_line_break_is_refused(headers, why):
    with pytest.raises(ConfigError, match=why):
        parse_config({"upstream": [{"name": "r", "url": "https://h", "headers": headers}]})


SECRET_PART = "sk-live-0123"


@pytest.mark.parametrize(
    "value",
    [
        SECRET_PART + "\r\nX-Evil: 1",
        SECRET_PART + "\n",  # a secret file read with its final newline
        SECRET_PART + "\r",
        "\n" + SECRET_PART,
        SECRET_PART + " ",
        " " + SECRET_PART,
        SECRET_PART + "\x7f",
        SECRET_PART + "\x1b[2J",
    ],
)
def test_an_auth_value_that_would_not_stay_one_header_value_is_refused(monkeypatch, value):
    from relay.proxy.upstreams import upstream_auth

    monkeypatch.setenv("R_KEY", value)
    [up] = parse_config(
        {
            "upstream": [
                {"name": "r", "url": "https://h", "auth_header": "X-Key", "auth_value_env": "R_KEY"}
            ]
        }
    ).upstream
    with pytest.raises(ConfigError) as exc:
        upstream_auth(up)
    msg = str(exc.value)
    assert msg == (
        "auth_value_env: environment variable R_KEY: the value has control "
        "characters (CR, LF, ...) or blanks at its ends"
    )


@pytest.mark.parametrize(
    "value,sent",
    [
        ("Bearer sk-1", b"Bearer sk-1"),
        ("a\tb", b"a\tb"),  # a TAB inside a value is a value's
        ("cl\u00e9", "cl\u00e9".encode()),
    ],
)
def test_an_auth_value_that_stays_one_header_value_is_sent_as_it_is(monkeypatch, value, sent):
    from relay.proxy.upstreams import upstream_auth

    monkeypatch.setenv("R_KEY", value)
    [up] = parse_config(
        {
            "upstream": [
                {"name": "r", "url": "https://h", "auth_header": "X-Key", "auth_value_env": "R_KEY"}
            ]
        }
    ).upstream
    assert upstream_auth(up) == (b"X-Key", sent)


# ---- issue 34 item 6: errors that point, in one style ------------------------------------------
# A key path is dotted from the top; an [[array]] item is named by its position and its name
# (or id): `upstream[1] (name "b").fallback`. The command line puts the file in front.
@pytest.mark.parametrize(
    "data,message",
    [
        ({"server": {"prot": 1}}, "server.prot: unknown key; did you mean port?"),
        ({"servr": {}}, "servr: unknown key; did you mean server?"),
        (
            {"upstream": [UP, {"name": "b", "url": "http://h", "paralel": 2}]},
            'upstream[1] (name "b").paralel: unknown key; did you mean parallel?',
        ),
        (
            {"key": [{"id": "k", "sha256": SHA, "token_per_day": 1}]},
            'key[0] (id "k").token_per_day: unknown key; did you mean tokens_per_day?',
        ),
        ({"otel": {"endpont": "http://c"}}, "otel.endpont: unknown key; did you mean endpoint?"),
        # nothing near: no guess
        ({"server": {"zzzz": 1}}, "server.zzzz: unknown key"),
    ],
)
def test_an_unknown_key_suggests_the_nearest_known_one(data, message):
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert str(exc.value) == message


def test_an_item_without_a_usable_name_is_named_by_its_position():
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [UP, {"name": 7, "url": "http://h"}]})
    assert str(exc.value) == "upstream[1].name: Expected `str`, got `int`"
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [UP, {"url": "http://h"}]})
    assert str(exc.value) == "upstream[1].name: required, missing"


def test_a_duplicate_is_named_with_the_item_it_repeats():
    ups = [UP, {"name": "b", "url": "http://h"}, dict(UP, url="http://other:1")]
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": ups})
    assert str(exc.value) == 'upstream[2] (name "llm").name: not unique, upstream[0] has it too'


@pytest.mark.parametrize(
    "up,message",
    [
        (
            {"name": "b", "url": "http://h", "fallback": ["x"]},
            'upstream[1] (name "b").fallback: unknown upstream "x"',
        ),
        ({"name": "b", "url": "http://h", "parallel": 0}, 'upstream[1] (name "b").parallel: '),
        ({"name": "b", "url": "ftp://h"}, 'upstream[1] (name "b").url: '),
        ({"name": "b", "url": "http://h", "verify": False}, 'upstream[1] (name "b").verify: '),
        (
            {"name": "b", "url": "http://h", "headers": {"Cookie": "x"}},
            'upstream[1] (name "b").headers: ',
        ),
    ],
)
def test_the_schema_and_the_cross_checks_name_an_upstream_alike(up, message):
    """Once `upstream[0].parallel` from the schema and `upstream.a.fallback` from the checks."""
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [UP, up]})
    assert str(exc.value).startswith(message)


def test_what_an_upstream_reads_at_start_is_named_alike(monkeypatch):
    from relay.config import at_upstream
    from relay.proxy.upstreams import upstream_auth

    monkeypatch.delenv("RELAY_TEST_UNSET_KEY", raising=False)
    cfg = parse_config(
        {
            "upstream": [
                UP,
                dict(UP, name="b", auth_header="X-Key", auth_value_env="RELAY_TEST_UNSET_KEY"),
            ]
        }
    )
    with pytest.raises(ConfigError) as exc, at_upstream(1, cfg.upstream[1]):
        upstream_auth(cfg.upstream[1])
    assert str(exc.value) == (
        'upstream[1] (name "b").auth_value_env: environment variable RELAY_TEST_UNSET_KEY is '
        "not set"
    )


def test_a_name_with_a_quote_or_a_control_character_is_shown_escaped():
    with pytest.raises(ConfigError) as exc:
        parse_config({"upstream": [{"name": 'a"\n', "url": "http://h", "parallel": 0}]})
    assert str(exc.value) == 'upstream[0] (name "a\\"\\n").parallel: Expected `int` >= 1'
