"""Flags that refuse nonsense (issue 34 item 2): a flag that cannot apply is an error naming the
flag, a flag's value is held to its config key's bounds and the error names the flag, not the
key; one line on stderr, exit status 2, as argparse's own errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from relay import cli
from tests.app.test_cli import run_to_end
from tests.support.processes import kill, start

UPSTREAM = '[[upstream]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'


def refused(capsys, argv: list[str]) -> str:
    """The one stderr line of a command line refused before anything runs."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


@pytest.mark.parametrize(
    "argv,line",
    [
        # 0 once became 4 without a word; -3 was refused naming no bound
        (
            ["serve", "--upstream", "http://h", "--parallel", "0"],
            "relay serve: error: --parallel: Expected `int` >= 1, not '0'",
        ),
        (
            ["serve", "--upstream", "http://h", "--parallel", "-3"],
            "relay serve: error: --parallel: Expected `int` >= 1, not '-3'",
        ),
        # once `server.workers: Expected int >= 1`: the key, not the flag
        (
            ["serve", "--upstream", "http://h", "--workers", "0"],
            "relay serve: error: --workers: Expected `int` >= 1, not '0'",
        ),
        (
            ["serve", "--upstream", "http://h", "--workers", "many"],
            "relay serve: error: --workers: a number or auto, not 'many'",
        ),
        (
            ["serve", "--upstream", "http://h", "--port", "70000"],
            "relay serve: error: --port: Expected `int` <= 65535, not '70000'",
        ),
        (
            ["serve", "--upstream", "http://h", "--host", ""],
            "relay serve: error: --host: empty (every interface is 0.0.0.0 or ::)",
        ),
        (
            ["serve", "--upstream", "127.0.0.1:8081"],
            "relay serve: error: --upstream: expected http://host[:port][/prefix] or "
            "https://host[:port][/prefix], not '127.0.0.1:8081'",
        ),
        (
            ["serve", "--parallel", "8"],
            "relay serve: error: --parallel: applies with --upstream or --demo only (an "
            "[[upstream]] in the file sets its own parallel)",
        ),
        (
            ["serve", "--demo", "--upstream", "http://h"],
            "relay serve: error: --demo: relays to the simulator; not with --upstream",
        ),
        (
            ["check", "--upstream", "http://h", "--port", "-1"],
            "relay check: error: --port: Expected `int` >= 0, not '-1'",
        ),
    ],
)
def test_a_flag_out_of_its_bounds_or_without_its_use_is_refused_naming_it(capsys, argv, line):
    assert refused(capsys, argv) == line


async def test_parallel_with_upstreams_in_the_file_is_refused_not_ignored(capsys, tmp_path):
    """The trap the README warns about: the file's [[upstream]] kept parallel = 1 and the
    flag said nothing."""
    cfg = tmp_path / "relay.toml"
    cfg.write_text("[server]\nport = 0\n" + UPSTREAM)
    line = refused(capsys, ["check", "--config", str(cfg), "--parallel", "8"])
    assert line.startswith("relay check: error: --parallel: applies with --upstream or --demo")
    # (A process: were the flag let through, the relay would serve.)
    proc = await start("serve", "--config", str(cfg), "--parallel", "8", cwd=str(tmp_path))
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        await kill(proc)
    assert proc.returncode == 2
    assert err.decode().startswith("relay serve: error: --parallel: applies with --upstream")


def test_the_flags_bounds_are_the_config_keys(capsys):
    """One rule for the file and the flag: the bounds are read from the config's fields."""
    assert cli.main(["check", "--upstream", "http://h:1", "--parallel", "65536"]) == 0
    assert "parallel 65536" in capsys.readouterr().out
    assert "65536" in refused(capsys, ["check", "--upstream", "http://h:1", "--parallel", "65537"])
    assert cli.main(["check", "--upstream", "http://h:1", "--port", "0", "--workers", "512"]) == 0
    capsys.readouterr()
    refused(capsys, ["check", "--upstream", "http://h:1", "--workers", "513"])


async def test_a_flag_that_cannot_apply_to_the_file_is_named_by_serve(tmp_path):
    cfg = tmp_path / "relay.toml"
    cfg.write_text(UPSTREAM)
    code, err = await run_to_end("serve", "--config", str(cfg), "--upstream", "http://h:1")
    assert code == 2
    assert err == (
        f"relay serve: error: --upstream: {cfg} already has [[upstream]]; give one or the other\n"
    )


async def test_a_file_error_stays_a_log_line_naming_the_file(tmp_path):
    cfg = tmp_path / "relay.toml"
    cfg.write_text(UPSTREAM + "parallel = 0\n")
    code, err = await run_to_end("serve", "--config", str(cfg), "--port", "0")
    [rec] = [json.loads(line) for line in err.splitlines()]
    assert code == 2 and rec["event"] == "relay_start_failed"
    assert rec["error"] == f'{cfg}: upstream[0] (name "a").parallel: Expected `int` >= 1'
