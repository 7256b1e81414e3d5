"""The command line, as a user runs it: real processes, real signals. It explains itself (issue 13
item 5): `relay --help` lists every command, `relay --version`, `relay sim --help` names every
knob with its unit and default; and the access log line names the client's address and
User-Agent (bounded)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import sys

import pytest

from relay import __version__, cli
from relay.observe.record import MAX_AGENT_CHARS
from tests.support import httpc
from tests.support.fixtures import ROOT
from tests.support.helpers import wait_for
from tests.support.processes import kill, start, wait_listening


async def run_to_end(
    *args: str, stdout: bool = False, env: dict | None = None, cwd=None
) -> tuple[int, str]:
    proc = await start(*args, env=env, cwd=None if cwd is None else str(cwd))
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    return proc.returncode, (out if stdout else err).decode()


async def test_unknown_config_key_is_rejected_naming_it(tmp_path):
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        '[server]\nport = 0\nbogus = 1\n[[upstream]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    code, err = await run_to_end("serve", "--config", str(cfg))
    assert code == 2
    assert "server" in err and "bogus" in err


async def test_out_of_range_value_is_rejected_naming_key_and_range(tmp_path):
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        "[dispatcher]\ndirect_read_timeout_s = 5\n"
        '[[upstream]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    code, err = await run_to_end("serve", "--config", str(cfg))
    assert code == 2
    assert "dispatcher.direct_read_timeout_s" in err and ">= 30.0" in err


async def test_missing_upstream_is_a_clear_error():
    code, err = await run_to_end("serve", "--port", "0")
    assert code == 2 and "no upstream" in err


async def test_demo_answers_a_stream_then_sigterm_drains_and_exits_zero(tmp_path):
    proc = await start("serve", "--demo", "--port", "0", cwd=str(tmp_path))
    try:
        port, _ = await wait_listening(proc)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            httpc.build_request("POST", "/v1/chat/completions", httpc.chat(12, interval_ms=20))
        )
        resp = await asyncio.wait_for(httpc.read_head(reader), 10)
        assert resp.status == 200
        proc.send_signal(signal.SIGTERM)  # mid-stream: the stream must still finish
        await asyncio.wait_for(httpc.read_body(reader, resp), 10)
        writer.close()
        assert resp.complete and resp.data_events()[-1] == "[DONE]"
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        rest = (await proc.stderr.read()).decode()
        events = [json.loads(x)["event"] for x in rest.splitlines() if x.startswith("{")]
        assert "relay_draining" in events and events[-1] == "relay_stopped"
        access = [json.loads(x) for x in rest.splitlines() if '"event":"access"' in x]
        assert access and access[-1]["outcome"] == "done"
        # the row was flushed at shutdown and `relay report` reads it
        code, out = await run_to_end(
            "report", "--db", str(tmp_path / "relay.db"), "--json", stdout=True
        )
        assert code == 0
        assert sum(g["requests"] for g in json.loads(out)["groups"]) == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sim_subcommand_serves_health():
    proc = await start("sim", "--port", "0")
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        port = json.loads(line)["port"]
        resp = await httpc.fetch(port, "GET", "/health")
        assert resp.json() == {"status": "ok"}
    finally:
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_unwritable_store_is_a_clear_error(tmp_path):
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'[store]\npath = "{tmp_path}/missing/dir/relay.db"\n'
        '[[upstream]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    code, err = await run_to_end("serve", "--config", str(cfg), "--port", "0")
    assert code == 2
    assert "store.path" in err and "unable to open database file" in err
    assert "Traceback" not in err


async def test_a_secret_in_the_file_or_an_unreadable_ca_file_stops_the_start(tmp_path):
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        '[server]\nport = 0\n[[upstream]]\nname = "openai"\n'
        'url = "https://api.example.com/v1"\n'
        'headers = { "Authorization" = "Bearer sk-in-file" }\n'
    )
    code, err = await run_to_end("serve", "--config", str(cfg))
    assert code == 2
    [rec] = _all_json(err)
    assert rec["error"].startswith(
        f"{cfg}: upstream[0] (name \"openai\").headers: 'Authorization' looks like a credential"
    )
    assert "sk-in-file" not in err
    cfg.write_text(
        '[server]\nport = 0\n[[upstream]]\nname = "openai"\n'
        'url = "https://api.example.com/v1"\n'
        f'ca_file = "{tmp_path / "missing.pem"}"\n'
    )
    code, err = await run_to_end("serve", "--config", str(cfg))
    [rec] = _all_json(err)
    assert code == 2 and rec["error"].startswith(f'{cfg}: upstream[0] (name "openai").ca_file: ')


def _all_json(err: str) -> list[dict]:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines
    out = []
    for ln in lines:
        assert ln.startswith("{"), f"a plain-text line on stderr: {ln!r}"
        out.append(json.loads(ln))
    return out


async def test_every_stderr_line_is_json(tmp_path):
    # a config error, a store that cannot open: one JSON line each, naming the problem
    code, err = await run_to_end("serve", "--port", "0")
    assert code == 2 and "no upstream" in _all_json(err)[0]["error"]
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'[store]\npath = "{tmp_path}/missing/dir/relay.db"\n'
        '[[upstream]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    code, err = await run_to_end("serve", "--config", str(cfg), "--port", "0")
    [rec] = _all_json(err)
    assert code == 2 and rec["event"] == "relay_start_failed" and "store.path" in rec["error"]
    # a demo run, served and stopped
    proc = await start("serve", "--demo", "--port", "0", cwd=str(tmp_path))
    try:
        port, _ = await wait_listening(proc)
        resp = await httpc.fetch(port, "POST", "/v1/chat/completions", httpc.chat(3))
        assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    _, err = await proc.communicate()
    events = [r["event"] for r in _all_json(err.decode())]
    assert "demo_try" in events and events[-1] == "relay_stopped"


# ---- the command line explains itself (issue 13 item 5) ------------------------------------------
CHAT = "/v1/chat/completions"


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        cli.main(argv)
    return exc.value.code, out.getvalue()


def test_help_lists_every_command():
    code, text = run(["--help"])
    assert code == 0
    for cmd in ("serve", "check", "key", "report", "sim"):
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


# ---- errors that point (issue 34 item 6) ---------------------------------------------------------
async def test_sim_on_a_busy_port_says_so_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = await run_to_end("sim", "--port", str(port))
    assert code == 1
    assert (
        err
        == f"relay sim: 127.0.0.1:{port}: address already in use (--port 0 takes any free one)\n"
    )


async def test_report_into_a_reader_gone_early_ends_quietly(tmp_path):
    """`relay report | head -1`: once a BrokenPipeError traceback. Here the reader has gone
    before the first byte: every write fails, as it does once head has its line."""
    from relay.store.sqlite import Store

    store = Store(str(tmp_path / "relay.db"), retention_days=0)
    store.start()
    for i in range(50):
        store.put({"request_id": f"r{i}", "model": f"m{i}", "ok": 1, "status": 200})
    store.close()
    read, write = os.pipe()
    os.close(read)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "relay", "report", "--db", str(tmp_path / "relay.db"),
            "--since", "all", stdout=write, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    finally:
        os.close(write)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert (proc.returncode, err) == (141, b"")


async def test_a_refused_sighup_names_the_file_and_the_changed_key(tmp_path):
    cfg = tmp_path / "relay.toml"
    text = (
        f'[server]\nport = 0\n[store]\npath = "{tmp_path / "relay.db"}"\n'
        '[[upstream]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    cfg.write_text(text)
    proc = await start("serve", "--config", str(cfg))
    try:
        await wait_listening(proc)
        cfg.write_text(text.replace("port = 0", "port = 1"))
        proc.send_signal(signal.SIGHUP)
        while True:
            rec = json.loads(await asyncio.wait_for(proc.stderr.readline(), 20))
            if rec["event"].startswith("config_reload"):
                break
        assert rec["event"] == "config_reload_failed"
        assert rec["reason"] == f"{cfg}: server.port: changing it needs a restart (0 -> 1)"
        cfg.write_text(text + "paralel = 2\n")
        proc.send_signal(signal.SIGHUP)
        while True:
            rec = json.loads(await asyncio.wait_for(proc.stderr.readline(), 20))
            if rec["event"].startswith("config_reload"):
                break
        assert rec["reason"] == (
            f'{cfg}: upstream[0] (name "a").paralel: unknown key; did you mean parallel?'
        )
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        await kill(proc)
