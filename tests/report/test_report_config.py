"""`relay report --config F` (issue 34 item 9): the rows are read where the relay's config file
keeps them (`[store].path`, or `url` with the password from `password_env`); an explicit `--db`
wins, and the report says so."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from relay.report import summary as report
from relay.sim.server import Simulator
from relay.store.sqlite import Store
from tests.support.fixtures import ROOT
from tests.support.pg_relays import Relay, chat, config
from tests.support.pg_server import PASSWORD_ENV

UPSTREAM = '[[upstream]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'


def store_with(path, n: int) -> None:
    store = Store(str(path), retention_days=0)
    store.start()
    for i in range(n):
        store.put({"request_id": f"r{i}", "model": "m", "ok": 1, "status": 200})
    store.close()


def requests(capsys, *argv: str) -> tuple[int, int, str]:
    """(exit status, requests counted, stderr) of one report."""
    code = report.main([*argv, "--since", "all", "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out)["total"]["requests"] if code == 0 else -1), err


def test_the_store_path_of_the_config_is_read_from_the_working_directory(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "data").mkdir()
    store_with(tmp_path / "data" / "relay.db", 3)
    store_with(tmp_path / "relay.db", 1)
    cfg = tmp_path / "relay.toml"
    cfg.write_text(UPSTREAM + '[store]\npath = "data/relay.db"\n')
    monkeypatch.chdir(tmp_path)
    assert requests(capsys, "--config", str(cfg)) == (0, 3, "")
    # Without --config: relay.db, as before.
    assert requests(capsys) == (0, 1, "")


def test_an_explicit_db_wins_and_the_report_says_so(tmp_path, capsys):
    store_with(tmp_path / "config.db", 3)
    store_with(tmp_path / "flag.db", 2)
    cfg = tmp_path / "relay.toml"
    cfg.write_text(UPSTREAM + f'[store]\npath = "{tmp_path / "config.db"}"\n')
    code, n, err = requests(capsys, "--config", str(cfg), "--db", str(tmp_path / "flag.db"))
    assert (code, n) == (0, 2)
    assert err == f"relay report: --db given: the [store] of {cfg} is not read\n"


def test_a_config_that_does_not_load_stops_the_report_naming_it(tmp_path, capsys):
    cfg = tmp_path / "relay.toml"
    cfg.write_text(UPSTREAM + "[store]\npaht = 'x.db'\n")
    code, _, err = requests(capsys, "--config", str(cfg))
    assert code == 2
    assert err == f"relay report: {cfg}: store.paht: unknown key; did you mean path?\n"
    code, _, err = requests(capsys, "--config", str(tmp_path / "none.toml"))
    assert code == 2 and "none.toml: cannot read: No such file or directory" in err


async def _report(*argv: str, env: dict) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay", "report", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode(), err.decode()


async def test_the_postgresql_store_is_read_with_the_password_of_password_env(tmp_path, pg_server):
    """The server wants a password on TCP; libpq's PGPASSWORD is not set: only the variable
    `[store].password_env` names gives it."""
    sim = Simulator()
    await sim.start()
    db = pg_server.create_db()
    cfg = config(tmp_path, "r0", sim.port, pg_server.url(db))
    relay = await Relay(cfg).start()
    try:
        assert await chat(relay.port, "one") == 200
    finally:
        assert await relay.stop() == 0
        await sim.stop()
    env = {k: v for k, v in os.environ.items() if k != "PGPASSWORD"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PGPASSFILE"] = str(tmp_path / "no-pgpass")
    code, out, err = await _report("--config", cfg, "--since", "all", "--json", env=env)
    assert code == 0, err
    assert json.loads(out)["total"]["requests"] == 1
    del env[PASSWORD_ENV]
    code, out, err = await _report("--config", cfg, "--since", "all", "--json", env=env)
    assert (code, out) == (2, "")
    assert err == (
        f"relay report: {cfg}: store.password_env: environment variable {PASSWORD_ENV} is not set\n"
    )
