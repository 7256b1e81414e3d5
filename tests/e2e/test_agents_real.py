"""The two real coding agents, one turn each, through the relay to a REAL llama-server (issue
22): Claude Code (`claude -p`, Anthropic Messages) and Codex CLI (`codex exec`, a
`wire_api = "responses"` provider). Each ends its turn with the model's answer, and each of
its rows is exact with llama-server's own figures.

The agents are the pinned npm packages of tests/e2e/agents/package.json, installed by
.ci/run into ~/.cache/relay-e2e/agents (or $RELAY_AGENTS: the folder holding
node_modules/.bin); without them the test skips (fails under CI=true). By hand:

    npm install --prefix ~/.cache/relay-e2e/agents $(python -c 'import json;d=json.load(open("tests/e2e/agents/package.json"))["dependencies"];print(" ".join(f"{k}@{v}" for k,v in d.items()))')
    .venv/bin/pytest tests/e2e/test_agents_real.py

The model is the tiny deterministic one written with a 64k context (their system prompts and
tools are 13-21k tokens) and "." ending its answer, so a turn is "Hello from a tiny llama."
and a stop.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from tests.support.helpers import rows
from tests.support.need import missing

from .llama_server import start_or_fail
from .rawhttp import request
from .tiny_gguf import AGENT_TEXT

pytestmark = pytest.mark.e2e

AGENTS = Path(os.environ.get("RELAY_AGENTS", Path.home() / ".cache" / "relay-e2e" / "agents"))
BIN = AGENTS / "node_modules" / ".bin"
TURN_TIMEOUT = 180.0


def agent(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        missing(f"needs the {name} agent at {path}: see tests/e2e/test_agents_real.py")
    return path


@pytest.fixture(scope="module")
def agent_server(llama_build):
    srv = start_or_fail(
        binary=llama_build.binary,
        extra_args=("-c", "65536", "-np", "1"),
        model={"n_ctx_train": 65536, "ends_turn": True},
    )
    try:
        yield srv
    finally:
        srv.cleanup()


async def predicted_total(port: int) -> float:
    text = (await request(port, "GET", "/metrics")).body.decode()
    return float(re.search(r"^llamacpp:tokens_predicted_total (\S+)", text, re.M).group(1))


async def run(cmd: list, env: dict, cwd: Path) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *map(str, cmd),
        env=env,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), TURN_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, out.decode(errors="replace")


def base_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    env.update(HOME=str(home), DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1")
    return env


async def check_rows(app, path: str, agent_name: str, server_port: int, before: float):
    got = [r for r in rows(app) if r["path"] == path]
    assert got, f"{agent_name} sent nothing to {path}"
    for r in got:
        assert (r["status"], r["ok"], r["tokens_source"]) == (200, 1, "exact"), r
        assert r["prompt_tokens"] > 5000  # its system prompt and tools, counted by the server
        assert r["ttft_ms"] is not None and r["ttft_ms"] <= r["total_ms"]
    predicted = await predicted_total(server_port) - before
    assert sum(r["completion_tokens"] for r in got) == predicted


async def test_claude_code_one_turn(agent_server, make_relay, tmp_path):
    claude = agent("claude")
    app = await make_relay(url=agent_server.url, parallel=1)
    env = base_env(tmp_path)
    env.update(
        ANTHROPIC_BASE_URL=f"http://127.0.0.1:{app.port}",
        ANTHROPIC_API_KEY="sk-e2e",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_ERROR_REPORTING="1",
    )
    before = await predicted_total(agent_server.port)
    rc, out = await run(
        [claude, "-p", "Say hi", "--model", "tiny", "--max-turns", "1"], env, tmp_path
    )
    assert rc == 0, out
    assert out.strip().endswith(AGENT_TEXT), out
    await check_rows(app, "/v1/messages", "claude", agent_server.port, before)


async def test_codex_one_turn(agent_server, make_relay, tmp_path):
    codex = agent("codex")
    app = await make_relay(url=agent_server.url, parallel=1)
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "relay"\n\n[model_providers.relay]\nname = "relay"\n'
        f'base_url = "http://127.0.0.1:{app.port}/v1"\nwire_api = "responses"\n'
        'env_key = "RELAY_KEY"\n'
    )
    env = base_env(home)
    env["RELAY_KEY"] = "sk-e2e"
    before = await predicted_total(agent_server.port)
    cmd = [codex, "exec", "--skip-git-repo-check", "Say hi"]
    rc, out = await run(cmd, env, tmp_path)
    assert rc == 0, out
    assert out.strip().endswith(AGENT_TEXT), out
    await check_rows(app, "/v1/responses", "codex", agent_server.port, before)
