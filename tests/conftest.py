"""Fixtures for every test: the simulator, relays in this process, a PostgreSQL server. Helpers
to import live in tests/support/ (the captured llama-server exchanges: fixtures.py)."""

import asyncio
import os

import pytest

from relay.app import App
from relay.config import (
    BalanceConfig,
    Config,
    DispatcherConfig,
    ServerConfig,
    StoreConfig,
    UpstreamConfig,
)
from relay.observe.log import quiet
from relay.sim.server import SimDefaults, Simulator
from tests.support.need import extra_hint, missing


@pytest.fixture
async def sim():
    s = Simulator()
    await s.start()
    yield s
    await s.stop()


@pytest.fixture
async def sim_b():
    """A second simulator, serving another model (`models/b.gguf`)."""
    s = Simulator(defaults=SimDefaults(model="models/b.gguf"))
    await s.start()
    yield s
    await s.stop()


@pytest.fixture
async def make_relay(sim):
    """Build a relay on a free port in front of `sim` (or `url`), with field overrides.

    Config structs are built directly, so bounds below the ranges docs/configuration.md gives (tiny
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
        otel=None,
        balance: BalanceConfig | None = None,
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
            otel=otel,
            balance=balance or BalanceConfig(),
        )
        app = App(cfg, quiet())
        await app.start()
        apps.append(app)
        return app

    yield make
    for app in apps:
        await app.stop(drain_timeout_s=0.5)


def pytest_asyncio_loop_factories(config, item):
    """The relay runs on uvloop where it is installed (`relay serve` does): test it there."""
    try:
        import uvloop
    except ImportError:
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


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
    """A real PostgreSQL server for the session (tests/support/pg_server.py). Without the
    driver (the postgres extra) or the server binaries the tests skip naming what is missing,
    and fail under CI=true."""
    from tests.support.pg_server import PASSWORD, PASSWORD_ENV, PgServer, find_bin

    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        missing(f"{extra_hint('postgres')} ({exc})")
    bindir = find_bin()
    if bindir is None:
        missing(
            "needs the PostgreSQL server binaries (initdb, pg_ctl): apt-get install postgresql,"
            " or set PG_BIN to their folder"
        )
    server = PgServer(bindir)
    os.environ[PASSWORD_ENV] = PASSWORD
    try:
        server.init()
        yield server
    finally:
        server.destroy()
