"""`relay key new` (issue 34 item 4): a fresh secret, shown once, and the `[[key]]` block with
its sha256 and limits, ready to paste: the block parses with the config loader, `relay check`
passes with it, and a running relay admits the secret."""

from __future__ import annotations

import asyncio
import hashlib
import re
import signal
import tomllib

import pytest

from relay.cli import key_block
from relay.config import parse_config
from tests.app.test_cli import run_to_end
from tests.app.test_flags import refused
from tests.support import httpc
from tests.support.processes import kill, start, wait_listening


async def key_new(*flags: str) -> tuple[str, str]:
    """(the block on stdout, the secret from stderr) of one `relay key new`."""
    proc = await start("key", "new", *flags)
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err
    note, secret = err.decode().splitlines()
    assert note.startswith("relay key new: the secret of key ") and "shown once" in note
    return out.decode(), secret


async def test_a_key_pasted_into_the_config_is_admitted_by_a_running_relay(tmp_path, sim):
    block, secret = await key_new("--id", "team-a", "--requests-per-day", "2")
    assert re.fullmatch(r"rk-[A-Za-z0-9_-]{43}", secret)
    digest = hashlib.sha256(secret.encode()).hexdigest()
    assert block == f'[[key]]\nid = "team-a"\nsha256 = "{digest}"\nrequests_per_day = 2\n'
    assert secret not in block
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'[server]\nport = 0\n[store]\npath = "{tmp_path / "relay.db"}"\n'
        f'[[upstream]]\nname = "sim"\nurl = "http://127.0.0.1:{sim.port}"\n\n' + block
    )
    code, out = await run_to_end("check", "--config", str(cfg), stdout=True)
    assert code == 0 and "key       team-a: requests_per_day 2" in out
    proc = await start("serve", "--config", str(cfg))
    try:
        port, _ = await wait_listening(proc)
        chat = httpc.chat(2)
        ok = await httpc.fetch(port, "POST", "/v1/chat/completions", chat, headers=_bearer(secret))
        assert ok.status == 200 and ok.complete
        wrong = await httpc.fetch(
            port, "POST", "/v1/chat/completions", chat, headers=_bearer(secret + "x")
        )
        assert wrong.status == 401
        # Its limit came with it: the second of 2 a day passes, the third is refused.
        again = await httpc.fetch(
            port, "POST", "/v1/chat/completions", chat, headers=_bearer(secret)
        )
        over = await httpc.fetch(
            port, "POST", "/v1/chat/completions", chat, headers=_bearer(secret)
        )
        assert (again.status, over.status) == (200, 429)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        await kill(proc)


def _bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


async def test_each_key_gets_its_own_secret():
    (_, one), (_, two) = await key_new("--id", "a"), await key_new("--id", "a")
    assert one != two


@pytest.mark.parametrize("key_id", ['team "a"', "back\\slash", "tab\there", "del\x7f", "caf\u00e9"])
def test_the_block_parses_with_the_loader_whatever_the_id(key_id):
    block = key_block(key_id, "ab" * 32, {"requests_per_day": 0, "tokens_per_month": 7})
    [key] = parse_config(tomllib.loads(block)).key
    assert (key.id, key.sha256, key.tokens_per_month, key.requests_per_day) == (
        key_id,
        "ab" * 32,
        7,
        0,
    )
    assert "requests_per_day" not in block


def test_its_flags_are_held_to_the_keys_bounds(capsys):
    line = refused(capsys, ["key", "new", "--id", "a", "--tokens-per-day", "-5"])
    assert line == "relay key new: error: --tokens-per-day: Expected `int` >= 0, not '-5'"
    line = refused(capsys, ["key", "new", "--id", ""])
    assert line == "relay key new: error: --id: Expected `str` of length >= 1, not ''"
    assert "--id" in refused(capsys, ["key", "new"])


async def test_the_limits_that_act_now_and_the_share_come_with_the_block(tmp_path, sim):
    block, _ = await key_new(
        "--id", "batch", "--max-concurrent", "3", "--requests-per-minute", "60",
        "--tokens-per-minute", "9000", "--priority", "low", "--weight", "2",
    )  # fmt: skip
    [key] = parse_config(tomllib.loads(block)).key
    assert (
        key.max_concurrent,
        key.requests_per_minute,
        key.tokens_per_minute,
        key.priority,
        key.weight,
    ) == (3, 60, 9000, "low", 2)
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'[server]\nport = 0\n[[upstream]]\nname = "sim"\nurl = "http://127.0.0.1:{sim.port}"\n\n'
        + block
    )
    code, out = await run_to_end("check", "--config", str(cfg), stdout=True)
    assert code == 0
    assert (
        "key       batch: max_concurrent 3, requests_per_minute 60, tokens_per_minute 9000, "
        "priority low, weight 2"
    ) in out


def test_a_number_is_a_priority_too(capsys):
    line = refused(capsys, ["key", "new", "--id", "a", "--priority", "urgent"])
    assert (
        line
        == "relay key new: error: --priority: high, normal, low or a whole number, not 'urgent'"
    )
    line = refused(capsys, ["key", "new", "--id", "a", "--priority", "101"])
    assert line.startswith("relay key new: error: --priority: ")
    block = key_block("a", "ab" * 32, {}, -5, 1)
    assert parse_config(tomllib.loads(block)).key[0].rank == -5
