"""The command line explains itself (issue 13 item 5): `relay --help` lists every command,
`relay --version`, `relay sim --help` names every knob with its unit and default; and the
access log line names the client's address and User-Agent (bounded)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from relay import __version__, cli
from relay.observe.record import MAX_AGENT_CHARS
from tests import httpc
from tests.conftest import wait_for

CHAT = "/v1/chat/completions"


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        cli.main(argv)
    return exc.value.code, out.getvalue()


def test_help_lists_every_command():
    code, text = run(["--help"])
    assert code == 0
    for cmd in ("serve", "report", "sim"):
        assert re.search(rf"^\s+{cmd}\s+\S", text, re.M), cmd
    assert "--version" in text


def test_version():
    assert run(["--version"]) == (0, f"relay {__version__}\n")


def test_sim_help_documents_every_knob():
    code, text = run(["sim", "--help"])
    assert code == 0
    flat = " ".join(text.split())
    for flag, default in (
        ("--host", "127.0.0.1"),
        ("--port", "8081"),
        ("--tokens", "16"),
        ("--interval-ms", "0.0"),
        ("--first-token-delay-ms", "0.0"),
        ("--head-delay-ms", "0.0"),
        ("--model", "models/tiny.gguf"),
    ):
        assert flag in flat and f"default {default}" in flat, flag
    assert flat.count("milliseconds") >= 3
    import inspect

    from relay.sim import plan as sim_plan
    from relay.sim import server as sim_server

    src = inspect.getsource(sim_plan) + inspect.getsource(sim_server)
    knobs = set(re.findall(r'(?:sim|knobs)\.get\("([a-z_]+)"', src))
    assert knobs >= {"tokens", "interval_ms", "stall_after", "drop_after", "status"}
    for knob in knobs:
        assert re.search(rf"^\s+{knob}\s+(int|float|bool|str)\s+.*default", text, re.M), knob


async def test_access_line_names_client_and_user_agent(make_relay):
    app = await make_relay()
    agent = "bench/1.0 " + "x" * 5000
    resp = await httpc.fetch(app.port, "POST", CHAT, httpc.chat(2), headers={"User-Agent": agent})
    assert resp.status == 200
    resp = await httpc.fetch(app.port, "POST", CHAT, b"{", headers={"User-Agent": "a\x01b"})
    assert resp.status == 400
    await wait_for(lambda: len(app.log.of("access")) == 2)
    first, second = app.log.of("access")
    assert first["client_addr"] == "127.0.0.1"
    assert first["user_agent"] == agent[:MAX_AGENT_CHARS]
    assert second["client_addr"] == "127.0.0.1" and second["user_agent"] == "a?b"
