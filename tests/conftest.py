import asyncio
import socket

import pytest

from relay.app import App
from relay.config import (
    Config,
    DispatcherConfig,
    ServerConfig,
    StoreConfig,
    UpstreamConfig,
)
from relay.observe.log import quiet
from relay.sim.server import Simulator


@pytest.fixture
async def sim():
    s = Simulator()
    await s.start()
    yield s
    await s.stop()


@pytest.fixture
async def make_relay(sim):
    """Build a relay on a free port in front of `sim` (or `url`), with field overrides.

    Config structs are built directly, so bounds below DESIGN.md's start-up ranges (tiny
    timeouts) are allowed here: tests drive time with small bounds instead of sleeping.
    """
    apps = []

    async def make(
        url: str | None = None,
        upstreams: list | None = None,
        keys: list = (),
        store: str = ":memory:",
        admin_key_sha256: str | None = None,
        parallel: int = 256,
        queue: int = 64,
        **fields,
    ) -> App:
        server = {k: v for k, v in fields.items() if k in ServerConfig.__struct_fields__}
        disp = {k: v for k, v in fields.items() if k in DispatcherConfig.__struct_fields__}
        unknown = set(fields) - set(server) - set(disp)
        assert not unknown, unknown
        disp.setdefault("health_interval_s", 0)  # no background probe unless a test wants one
        ups = upstreams or [
            UpstreamConfig(name="llm", url=url or sim.url, parallel=parallel, queue=queue)
        ]
        cfg = Config(
            server=ServerConfig(port=0, **server),
            dispatcher=DispatcherConfig(**disp),
            upstream=ups,
            key=list(keys),
            store=StoreConfig(path=store),
            admin_key_sha256=admin_key_sha256,
        )
        app = App(cfg, quiet())
        await app.start()
        apps.append(app)
        return app

    yield make
    for app in apps:
        await app.stop(drain_timeout_s=0.5)


async def wait_for(predicate, timeout: float = 5.0, step: float = 0.005):
    """Poll a condition the code under test makes true (bounded, fails loudly)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step)


def pytest_asyncio_loop_factories(config, item):
    """The relay runs on uvloop where it is installed (`relay serve` does): test it there."""
    try:
        import uvloop
    except ImportError:
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


def closed_port() -> int:
    """A port where nothing listens (bound, then released): a connect to it is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pytest_report_header(config):
    """Which llama-server binary each e2e parameter runs against (and which are not run)."""
    from tests.e2e.llama_server import builds, missing_e2e_modules, skipped_builds

    lines = [f"e2e llama-server [{b.name}]: {b.binary or 'missing'} ({b.note})" for b in builds()]
    lines += [f"e2e llama-server {s}" for s in skipped_builds()]
    missing = missing_e2e_modules()
    if missing:
        lines.append(f"e2e: missing {', '.join(missing)}: install the 'e2e' extra")
    return lines


@pytest.fixture(scope="session")
def pg_server():
    """A real PostgreSQL server for the session (tests/pg_server.py). Without the server
    binaries or the driver the tests skip, and fail under CI=true."""
    import os

    from tests.pg_server import PASSWORD, PASSWORD_ENV, PgServer, find_bin

    why = None
    try:
        import psycopg  # noqa: F401
    except ImportError:
        why = "psycopg (relay[postgres]) is not installed"
    bindir = find_bin()
    if why is None and bindir is None:
        why = "PostgreSQL server binaries (initdb, pg_ctl) not found"
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    server = PgServer(bindir)
    os.environ[PASSWORD_ENV] = PASSWORD
    try:
        server.init()
        yield server
    finally:
        server.destroy()
