"""`relay check --config F` (issue 34 item 3), as `nginx -t`: the check `relay serve` runs
before it starts, then what it would serve on stdout; exit 0, or 2 with the error. It opens no
store and binds no port."""

from __future__ import annotations

import json
import socket

from relay.config import parse_config
from relay.preflight import describe, pools
from tests.app.test_cli import run_to_end
from tests.support.keys import sha

A, B = "http://127.0.0.1:9", "http://127.0.0.1:10"


def write(tmp_path, text: str):
    cfg = tmp_path / "relay.toml"
    cfg.write_text(text)
    return cfg


FULL = f"""
admin_key_sha256 = "{sha("admin secret")}"

[server]
host = "127.0.0.1"
port = {{port}}
workers = 2

[[upstream]]
name = "gpu"
url = "{A}"
models = ["qwen", "llama"]
parallel = 4
queue = 16
fallback = ["cpu"]

[[upstream]]
name = "cpu"
url = "{B}"
models = ["qwen"]
aliases = ["gpt-4o-mini", "llama"]

[[key]]
id = "team-a"
sha256 = "{sha("team-a secret")}"
requests_per_day = 1000
tokens_per_month = 5000000

[[key]]
id = "ops"
sha256 = "{sha("ops secret")}"
"""


async def test_check_prints_what_it_would_serve_and_touches_nothing(tmp_path):
    # The port is in use: the check still passes (it binds nothing).
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = write(tmp_path, FULL.format(port=port))
        code, out = await run_to_end("check", "--config", str(cfg), stdout=True, cwd=tmp_path)
    assert code == 0, out
    assert out.splitlines() == [
        f"relay check: {cfg}: ok, it would serve:",
        f"listen    127.0.0.1:{port}, workers 2",
        f"upstream  gpu: {A}, parallel 4, queue 16, models qwen llama, aliases -, fallback cpu",
        f"upstream  cpu: {B}, parallel 1, queue 64, models qwen, aliases gpt-4o-mini llama, "
        "fallback -",
        "pool      qwen: gpu, cpu",
        # (llama is gpu's model and only cpu's alias: the model name wins, no pool)
        "key       team-a: requests_per_day 1000, tokens_per_month 5000000",
        "key       ops: no limits",
        "admin key set",
        f"store     SQLite {tmp_path / 'relay.db'}",
        "otel      off",
    ]
    assert sha("team-a secret") not in out and sha("admin secret") not in out
    # No store was opened: the SQLite file (and its journal) never appeared.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relay.toml"]


async def test_check_names_the_postgresql_store_without_a_password(tmp_path):
    cfg = write(
        tmp_path,
        f'[[upstream]]\nname = "a"\nurl = "{A}"\n'
        '[store]\nurl = "postgresql://relay@db.internal:5432/relay"\npassword_env = "RELAY_PG"\n',
    )
    code, out = await run_to_end(
        "check", "--config", str(cfg), stdout=True, env={"RELAY_PG": "s3cret-pw"}
    )
    assert code == 0, out
    assert "store     PostgreSQL postgresql://relay@db.internal:5432/relay, password from " in out
    assert "$RELAY_PG" in out and "s3cret-pw" not in out


async def test_check_fails_as_serve_fails_on_what_the_environment_lacks(tmp_path):
    """A missing auth_value_env (or password_env) variable: the same line from both, naming the
    file and the key; exit 2."""
    cfg = write(
        tmp_path,
        "[server]\nport = 0\n"
        f'[[upstream]]\nname = "a"\nurl = "{A}"\n'
        f'[[upstream]]\nname = "remote"\nurl = "{B}"\n'
        'auth_header = "Authorization"\nauth_value_env = "RELAY_TEST_UNSET_KEY"\n',
    )
    want = (
        f'{cfg}: upstream[1] (name "remote").auth_value_env: environment variable '
        "RELAY_TEST_UNSET_KEY is not set"
    )
    code, err = await run_to_end("check", "--config", str(cfg), cwd=tmp_path)
    assert (code, err) == (2, f"relay check: {want}\n")
    code, err = await run_to_end("serve", "--config", str(cfg), cwd=tmp_path)
    [rec] = [json.loads(line) for line in err.splitlines()]
    assert code == 2 and rec["event"] == "relay_start_failed" and rec["error"] == want
    # Set, the check passes.
    code, _ = await run_to_end(
        "check", "--config", str(cfg), env={"RELAY_TEST_UNSET_KEY": "Bearer x"}
    )
    assert code == 0
    cfg.write_text(
        f'[[upstream]]\nname = "a"\nurl = "{A}"\n'
        '[store]\nurl = "postgresql://u@h/db"\npassword_env = "RELAY_TEST_UNSET_PW"\n'
    )
    code, err = await run_to_end("check", "--config", str(cfg))
    assert code == 2
    assert err in (
        f"relay check: {cfg}: store.password_env: environment variable RELAY_TEST_UNSET_PW "
        "is not set\n",
        # (without the postgres extra, the driver is what is missing first)
        f"relay check: {cfg}: store.url: PostgreSQL needs the driver "
        "(pip install -e '.[postgres]')\n",
    )


async def test_check_refuses_a_bad_file_with_one_line_and_status_2(tmp_path):
    cfg = write(tmp_path, f'[server]\nprot = 8080\n[[upstream]]\nname = "a"\nurl = "{A}"\n')
    code, err = await run_to_end("check", "--config", str(cfg))
    assert (code, err) == (2, f"relay check: {cfg}: server.prot: unknown key; did you mean port?\n")
    code, err = await run_to_end("check", "--config", str(tmp_path / "none.toml"))
    assert (code, err) == (
        2,
        f"relay check: {tmp_path / 'none.toml'}: cannot read: No such file or directory\n",
    )


def test_pools_are_the_names_two_or_more_upstreams_serve_in_the_order_written():
    # A name some upstream lists in `models` is routed to those only; aliases come after.
    cfg = parse_config(
        {
            "upstream": [
                {"name": "a", "url": A, "models": ["m", "x"], "aliases": ["m"]},
                {"name": "b", "url": B, "aliases": ["x", "only-b"]},
                {"name": "c", "url": B, "models": ["m"]},
            ]
        }
    )
    assert pools(cfg.upstream) == {"m": ["a", "c"]}
    aliased = parse_config(
        {
            "upstream": [
                {"name": "a", "url": A, "aliases": ["fast"]},
                {"name": "b", "url": B, "aliases": ["fast"]},
            ]
        }
    )
    assert pools(aliased.upstream) == {"fast": ["a", "b"]}
    assert pools(cfg.upstream[:1]) == {}


def test_describe_notes_a_catch_all_past_the_first():
    ups = [
        {"name": "any1", "url": A},
        {"name": "gpu", "url": B, "models": ["m"], "fallback": ["any2"]},
        {"name": "any2", "url": B},
    ]
    lines = describe(parse_config({"upstream": ups}), "/")
    notes = [line for line in lines if line.startswith("note")]
    assert notes == [
        "note      any2: a catch-all after any1, reached only as another upstream's fallback"
    ]
    one = [ups[0], {**ups[1], "fallback": []}]
    assert not [line for line in describe(parse_config({"upstream": one}), "/") if "note" in line]


def test_describe_resolves_a_relative_store_path_and_names_the_memory_one():
    up = {"name": "a", "url": A}
    lines = describe(parse_config({"upstream": [up], "store": {"path": "data/r.db"}}), "/srv/x")
    assert "store     SQLite /srv/x/data/r.db" in lines
    lines = describe(parse_config({"upstream": [up], "store": {"path": "/var/r.db"}}), "/srv/x")
    assert "store     SQLite /var/r.db" in lines
    lines = describe(parse_config({"upstream": [up], "store": {"path": ":memory:"}}), "/srv")
    assert "store     SQLite in memory (rows and budgets end with the process)" in lines
    # A name with a control character in it is shown escaped.
    lines = describe(parse_config({"upstream": [{"name": "a\x1b[2Jb", "url": A}]}), "/")
    assert any(line.startswith('upstream  "a\\u001b[2Jb": ') for line in lines)
