"""The bench's framing scenarios (issue 15): load client knobs, the per-framing table, and the
load client counting exactly the tokens of every framing the simulator speaks."""

from __future__ import annotations

import json
import types

import pytest

from bench import framings, load
from relay.sim.server import Simulator


def _args(extra: list[str]):
    return load.parse_args(["--port", "1", "--max-tokens", "7", "--interval-ms", "2", *extra])


@pytest.mark.parametrize("name", sorted(framings.FRAMINGS))
def test_every_framing_scenario_asks_the_simulator_for_its_shape(name):
    knobs, usage, _ = framings.FRAMINGS[name]
    sc = framings.scenarios(
        types.SimpleNamespace(real_long_requests=20), {"concurrency": 5, "requests": 5}
    )[name]
    req = load.build_request(_args(sc["extra"]))
    body = json.loads(req.split(b"\r\n\r\n", 1)[1])
    assert body["sim"] == {"tokens": 7, "interval_ms": 2.0, **knobs}
    assert body.get("stream_options") == ({"include_usage": True} if usage else None)
    assert sc["concurrency"] == 5


def test_real_long_streams_500_tokens_from_the_real_server():
    sc = framings.scenarios(types.SimpleNamespace(real_long_requests=8), {})["real-long"]
    assert (sc["upstream"], sc["requests"], sc["max_tokens"], sc["extra"]) == (
        "real",
        8,
        500,
        ["--no-sim"],
    )


def test_an_empty_content_delta_is_not_a_token():
    assert load.CONTENT_RE.search(b'data: {"delta":{"content":"x"}}')
    assert load.CONTENT_RE.search(b'data: {"delta":{"content": "\\""}}')
    assert not load.CONTENT_RE.search(b'data: {"delta":{"role":"assistant","content":""}}')
    assert not load.CONTENT_RE.search(b'data: {"delta":{"content":null}}')


def _row(scenario, target, repeat, cpu_us, events=1000):
    return {
        "scenario": scenario,
        "target": target,
        "repeat": repeat,
        "proxy_cpu_us": cpu_us,
        "load": {"events": events},
    }


def test_summary_gives_each_repeats_ratio_and_the_medians():
    rows = [
        _row("paced-vllm", "relay", 0, 12000),
        _row("paced-vllm", "nginx", 0, 10000),
        _row("paced-vllm", "relay", 1, 15000),
        _row("paced-vllm", "nginx", 1, 10000),
        _row("paced-vllm", "relay", 2, 22000),
        _row("paced-vllm", "nginx", 2, 20000),
        _row("paced-vllm", "baseline", 0, 99000),
        _row("paced", "relay", 0, 5000),
    ]  # (no nginx run: no line)
    text = framings.summary(rows, ["paced", "paced-vllm"])
    line = [ln for ln in text.splitlines() if ln.startswith("| paced-vllm |")]
    # relay 12, 15, 22 µs/event; nginx 10, 10, 20: medians 15 and 10; ratios 1.2, 1.5, 1.1
    assert line == [
        "| paced-vllm | vLLM's chunks, usage: null on each | 15.00 | 10.00 | 1.50× | "
        "1.20× | 1.20×, 1.50×, 1.10× |"
    ]
    assert "| paced |" not in text
    assert framings.summary(rows[-1:], ["paced"]) == ""


@pytest.mark.parametrize("name", sorted(framings.FRAMINGS))
async def test_the_load_client_counts_every_token_of_every_framing(name):
    knobs, usage, _ = framings.FRAMINGS[name]
    async with Simulator() as sim:
        a = load.parse_args(
            [
                "--port",
                str(sim.port),
                "--concurrency",
                "3",
                "--requests",
                "3",
                "--max-tokens",
                "20",
                "--interval-ms",
                "1",
                "--timeout",
                "10",
                "--sim-knobs",
                json.dumps(knobs),
            ]
            + (["--include-usage"] if usage else [])
        )
        out = await load.run(a)
    assert (out["errors"], out["incomplete"], out["content_events"]) == (0, 0, 60), out
    # role (with the first token), 20 tokens, finish (+ usage), [DONE], each an event
    assert out["events"] == 3 * (1 + 20 + 1 + usage + 1)
