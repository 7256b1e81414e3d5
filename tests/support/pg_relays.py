"""Relay processes on one PostgreSQL (tests/store/test_pg_*.py): configs, start, stop, requests."""

from __future__ import annotations

import asyncio
import json
import signal

from tests.support import httpc
from tests.support.keys import SECRET, sha
from tests.support.pg_server import PASSWORD, PASSWORD_ENV
from tests.support.processes import start

CHAT = "/v1/chat/completions"


def config(
    tmp_path,
    name: str,
    sim_port: int,
    url: str,
    limit: int = 10,
    ttl: float = 30.0,
    parallel: int = 64,
    tokens: int = 0,
) -> str:
    """A relay's config file: key `alpha` with `limit` requests and `tokens` tokens a day
    (0: no limit)."""
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(
        f"[server]\nport = 0\n"
        f'[store]\nurl = "{url}"\npassword_env = "{PASSWORD_ENV}"\n'
        f'spill_path = "{tmp_path / (name + "-spill.jsonl")}"\nreservation_ttl_s = {ttl}\n'
        f'[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:{sim_port}"\n'
        f"parallel = {parallel}\nqueue = 1000\n"
        f'[[key]]\nid = "alpha"\nsha256 = "{sha(SECRET)}"\nrequests_per_day = {limit}\n'
        f"tokens_per_day = {tokens}\n"
    )
    return str(cfg)


class Relay:
    """`python -m relay serve` with its JSON log lines collected (a pipe nobody reads would
    fill up and stop the relay)."""

    def __init__(self, cfg: str) -> None:
        self.cfg = cfg
        self.lines: list[dict] = []
        self.raw: list[bytes] = []
        self.port = 0
        self.proc = None
        self._reader: asyncio.Task | None = None
        self._listening: asyncio.Future | None = None

    async def start(self) -> Relay:
        self.proc = await start("serve", "--config", self.cfg)
        self._listening = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())
        self.port = await asyncio.wait_for(self._listening, 30)
        return self

    async def _read(self) -> None:
        while line := await self.proc.stderr.readline():
            self.raw.append(line)
            if line.startswith(b"{"):
                rec = json.loads(line)
                self.lines.append(rec)
                if rec["event"] == "relay_listening" and not self._listening.done():
                    self._listening.set_result(rec["port"])
        if not self._listening.done():
            self._listening.set_exception(AssertionError(f"relay exited: {self.raw[-5:]}"))

    def events(self, name: str) -> list[dict]:
        return [r for r in self.lines if r["event"] == name]

    async def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        code = await asyncio.wait_for(self.proc.wait(), 30)
        await asyncio.wait_for(self._reader, 10)
        return code

    async def metric(self, name: str) -> float:
        resp = await httpc.fetch(self.port, "GET", "/metrics")
        for line in resp.body.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"no {name} in /metrics")

    def password_leaked(self) -> bool:
        return any(PASSWORD.encode() in line for line in self.raw)


def headers(rid: str) -> dict:
    return {"Authorization": f"Bearer {SECRET}", "X-Request-Id": rid}


async def chat(port: int, rid: str, tokens: int = 2) -> int:
    resp = await httpc.fetch(port, "POST", CHAT, httpc.chat(tokens, stream=False), headers(rid))
    return resp.status
