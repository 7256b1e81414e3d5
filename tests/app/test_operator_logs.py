"""Log lines an operator alerts on (issue 34, items 7 and 8): `config_reloaded` names every
changed key of each upstream, as the relay process writes it; a relay listening beyond
loopback with no key of any kind says at start what it exposes. (Each change of an upstream's
state: tests/app/test_health.py.)"""

import asyncio
import json
import signal

from relay.config import UpstreamConfig
from relay.reload import changed_keys
from relay.sim.server import Simulator
from tests.app.test_health import health, relay
from tests.app.test_signals import Tail
from tests.support.keys import OTHER_SECRET, key
from tests.support.processes import kill, start, wait_listening


def test_changed_keys_are_named_never_their_values():
    old = UpstreamConfig(name="a", url="http://h:1", parallel=2, headers={"X-Team": "red"})
    assert changed_keys(old, old) == []
    new = UpstreamConfig(name="a", url="http://h:2", parallel=4, headers={"X-Team": "blue"})
    assert changed_keys(old, new) == ["url", "parallel", "headers"]


async def test_config_reloaded_lists_every_changed_key_per_upstream(tmp_path):
    sim = Simulator()
    await sim.start()
    cfg, db = tmp_path / "relay.toml", tmp_path / "relay.db"

    def write(parallel: int, queue: int, second: str = "") -> None:
        cfg.write_text(
            f'[server]\nport = 0\n[dispatcher]\nhealth_interval_s = 0\n[store]\npath = "{db}"\n'
            f'[[upstream]]\nname = "a"\nurl = "{sim.url}"\nparallel = {parallel}\n'
            f'queue = {queue}\n[[upstream]]\nname = "b"\nurl = "{sim.url}"\n{second}'
        )

    write(2, 8)
    proc = await start("serve", "--config", str(cfg))
    try:
        await wait_listening(proc)
        log = Tail(proc)
        for parallel, queue, second, changed in (
            (4, 16, "", [{"upstream": "a", "changed": ["parallel", "queue"]}]),
            (
                4,
                16,
                'models = ["m"]\n',
                [{"upstream": "b", "changed": ["models"]}],
            ),
            (4, 16, 'models = ["m"]\n', []),  # the same file again: nothing changed
        ):
            write(parallel, queue, second)
            mark = len(log.lines)
            proc.send_signal(signal.SIGHUP)
            line = await log.wait("config_reloaded", mark)
            assert line["changed"] == changed
            assert (line["added"], line["removed"]) == ([], [])
    finally:
        await kill(proc)
        await sim.stop()


async def test_an_open_relay_warns_at_start_a_loopback_one_does_not(sim):
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        app = await relay([sim.url], host=host)
        try:
            opened = app.log.events("relay_open")
            assert bool(opened) is warned, host
            if warned:
                [line] = opened
                assert (line["host"], line["port"]) == (host, app.port)
                assert any("/slots" in e and "prompts" in e for e in line["exposed"])
                assert any("/metrics" in e for e in line["exposed"])
                assert "[[key]]" in line["fix"]
        finally:
            await app.stop(drain_timeout_s=0.5)
    # keys close it: no warning
    app = await relay([sim.url], host="0.0.0.0", keys=[key(secret=OTHER_SECRET)])
    try:
        assert not app.log.events("relay_open")
        assert (await health(app.port)).status == 200
    finally:
        await app.stop(drain_timeout_s=0.5)


async def test_relay_open_is_said_once_by_the_process_that_listens(tmp_path):
    """`relay serve --host 0.0.0.0` with no key: the line, after `relay_listening`, once (with
    workers: the parent's, not each worker's)."""
    sim = Simulator()
    await sim.start()
    try:
        for extra in ((), ("--workers", "2")):
            # (its store: relay.db in the working directory)
            proc = await start(
                "serve", "--upstream", sim.url, "--host", "0.0.0.0", "--port", "0", *extra,
                cwd=str(tmp_path),
            )  # fmt: skip
            try:
                await wait_listening(proc)
                proc.send_signal(signal.SIGTERM)
                _, err = await asyncio.wait_for(proc.communicate(), 40)
                lines = [json.loads(x) for x in err.splitlines() if x.startswith(b"{")]
                assert [e["event"] for e in lines].count("relay_open") == 1, extra
            finally:
                await kill(proc)
    finally:
        await sim.stop()
