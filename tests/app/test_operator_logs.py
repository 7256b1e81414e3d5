"""Log lines an operator alerts on (issue 34, item 7): `config_reloaded` names every changed
key of each upstream, as the relay process writes it. (Each change of an upstream's state:
tests/app/test_health.py.)"""

import signal

from relay.config import UpstreamConfig
from relay.reload import changed_keys
from relay.sim.server import Simulator
from tests.app.test_signals import Tail
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
