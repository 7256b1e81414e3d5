"""Whether OpenTelemetry is on and how it exports (`observe.otel_env`): `[otel]` and the
standard OTEL_* variables; off costs nothing (no import); `[otel]` without the extra fails at
start naming it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from relay.config import ConfigError, OtelConfig, parse_config
from relay.observe.log import quiet
from relay.observe.otel_env import settings
from relay.observe.otel_start import start
from tests.support.fixtures import ROOT

UP = [{"name": "llm", "url": "http://127.0.0.1:9"}]


def test_off_unless_the_file_or_an_endpoint_variable_says():
    assert settings(None, {}) is None
    assert settings(None, {"OTEL_SERVICE_NAME": "x"}) is None  # (no endpoint: off)
    for var in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ):
        s = settings(None, {var: "http://c:4318"})
        assert s is not None and not s.configured and s.traces and s.metrics
        # the SDK reads the endpoints itself: none is given in its place
        assert (s.traces_endpoint, s.metrics_endpoint) == (None, None)
    assert settings(OtelConfig(), {}).configured


def test_sdk_disabled_and_signals_turned_off():
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert settings(None, {**on, "OTEL_SDK_DISABLED": "TRUE"}) is None
    assert settings(OtelConfig(), {"OTEL_SDK_DISABLED": "true"}) is None
    assert settings(OtelConfig(disabled=True), {}) is None
    assert settings(OtelConfig(), {"OTEL_SDK_DISABLED": "false"}) is not None
    s = settings(None, {**on, "OTEL_TRACES_EXPORTER": "none"})
    assert s is not None and (s.traces, s.metrics) == (False, True)
    assert settings(OtelConfig(traces=False, metrics=False), {}) is None
    s = settings(OtelConfig(metrics=False), {})
    assert s is not None and (s.traces, s.metrics) == (True, False)


def test_the_file_wins_over_the_environment_and_appends_the_signal_paths():
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://e:1"}
    s = settings(OtelConfig(endpoint="http://c:4318/", protocol="http/protobuf"), env)
    assert s is not None and s.traces_protocol == s.metrics_protocol == "http/protobuf"
    assert s.traces_endpoint == "http://c:4318/v1/traces"
    assert s.metrics_endpoint == "http://c:4318/v1/metrics"
    s = settings(OtelConfig(endpoint="http://c:4318", traces_endpoint="http://t/x"), {})
    assert s is not None and s.traces_endpoint == "http://t/x"
    s = settings(OtelConfig(endpoint="http://c:4317"), env)
    assert s is not None and s.traces_protocol == "grpc" and s.traces_endpoint == "http://c:4317"
    s = settings(None, {**env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    assert s is not None and (s.traces_protocol, s.metrics_protocol) == ("http/protobuf", "grpc")
    with pytest.raises(ConfigError, match="http/json"):
        settings(None, {**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_service_name_relay_unless_named():
    assert settings(OtelConfig(), {}).resource == {"service.name": "relay"}
    assert settings(OtelConfig(service_name="edge"), {}).resource == {"service.name": "edge"}
    # the environment's name stands: the SDK's resource reads it (the file would override it)
    assert settings(OtelConfig(), {"OTEL_SERVICE_NAME": "env"}).resource == {}
    named = {"OTEL_RESOURCE_ATTRIBUTES": "a=1, service.name=env"}
    assert settings(OtelConfig(), named).resource == {}
    s = settings(OtelConfig(resource_attributes={"deployment.environment": "prod"}), {})
    assert s.resource == {"deployment.environment": "prod", "service.name": "relay"}


def test_otel_section_is_validated_like_every_other():
    cfg = parse_config(
        {
            "upstream": UP,
            "otel": {
                "endpoint": "http://127.0.0.1:4318",
                "traces_sampler": "parentbased_traceidratio",
                "traces_sampler_arg": 0.25,
                "metric_export_interval_ms": 5000,
            },
        }
    )
    assert cfg.otel is not None and cfg.otel.traces_sampler == "parentbased_traceidratio"
    assert parse_config({"upstream": UP}).otel is None
    with pytest.raises(ConfigError, match=r"otel\.bogus: unknown key"):
        parse_config({"upstream": UP, "otel": {"bogus": 1}})
    with pytest.raises(ConfigError, match=r"otel\.traces_sampler"):
        parse_config({"upstream": UP, "otel": {"traces_sampler": "sometimes"}})
    with pytest.raises(ConfigError, match=r"otel\.protocol"):
        parse_config({"upstream": UP, "otel": {"protocol": "http/json"}})


def test_grpc_without_its_exporter_is_refused_naming_it(monkeypatch):
    # As if the otel-grpc extra were not installed, also where it is: a None in sys.modules
    # makes the import fail.
    grpc = "opentelemetry.exporter.otlp.proto.grpc"
    for name in [grpc, f"{grpc}.trace_exporter"] + [m for m in sys.modules if m.startswith(grpc)]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-grpc") as exc:
        start(OtelConfig(protocol="grpc"), quiet(), list, {})
    # Installed from the checkout: PyPI's `relay` is another project.
    assert "pip install -e '.[otel-grpc]'" in str(exc.value)


BLOCK_OTEL = textwrap.dedent(
    """
    import importlib.abc, sys
    class NoOtel(importlib.abc.MetaPathFinder):  # as if the extra were not installed
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, NoOtel())
    """
)


def run_python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


def test_otel_in_the_config_without_the_extra_fails_at_start_naming_it(tmp_path):
    conf = tmp_path / "relay.toml"
    conf.write_text(
        '[[upstream]]\nname = "llm"\nurl = "http://127.0.0.1:9"\n\n'
        '[otel]\nendpoint = "http://127.0.0.1:4318"\n\n'
        f'[store]\npath = "{tmp_path / "r.db"}"\n'
    )
    code = BLOCK_OTEL + "from relay.cli import main; sys.exit(main(sys.argv[1:]))"
    done = run_python(code, "serve", "--config", str(conf), "--port", "0")
    assert done.returncode == 2, done.stderr
    [line] = [json.loads(x) for x in done.stderr.splitlines() if "relay_start_failed" in x]
    assert "'otel' extra" in line["error"] and "pip install -e '.[otel]'" in line["error"]


def test_the_environment_alone_without_the_extra_is_logged_and_off():
    code = BLOCK_OTEL + textwrap.dedent(
        """
        from relay.observe.log import quiet
        from relay.observe.otel_start import start
        import os
        log = quiet()
        assert start(None, log, list, os.environ) is None
        print(log.of("otel_extra_missing")[0]["note"])
        """
    )
    done = run_python(code, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert done.returncode == 0, done.stderr
    assert "pip install -e '.[otel]'" in done.stdout


def test_off_nothing_of_opentelemetry_is_imported_by_a_relayed_request():
    code = textwrap.dedent(
        """
        import asyncio, sys
        from relay.app import App
        from relay.config import Config, DispatcherConfig, ServerConfig, StoreConfig
        from relay.config import UpstreamConfig
        from relay.observe.log import quiet
        from relay.sim.server import Simulator
        from tests.support import httpc

        async def main():
            sim = Simulator()
            await sim.start()
            app = App(Config(server=ServerConfig(port=0),
                             dispatcher=DispatcherConfig(health_interval_s=0),
                             upstream=[UpstreamConfig(name="llm", url=sim.url)],
                             store=StoreConfig(path=":memory:")), quiet())
            await app.start()
            tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            resp = await httpc.fetch(app.port, "POST", "/v1/chat/completions",
                                     httpc.chat(3), {"traceparent": tp})
            assert resp.status == 200 and resp.complete
            assert app.otel is None
            await app.stop(drain_timeout_s=0.5)
            await sim.stop()

        asyncio.run(main())
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
