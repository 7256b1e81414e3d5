"""Framing scenarios (issue 15): the paced load on other servers' chunk shapes, side by side.

The relay's CPU per event must hold whatever the upstream's byte layout, so next to `paced`
(llama-server's chat chunks as the simulator writes them, one event per chunk per read) the
same load runs against the simulator speaking vLLM's and OpenAI's chunks (`usage: null` on
every chunk, OpenAI's random `obfuscation` padding: the load asks for include_usage) and
with several events per chunk or several chunks per write (so per read); and `real-long`
streams 500 tokens from the real llama-server (tests/e2e/llama_server.py), where per-event
work dominates, unlike `real`'s 64. `summary` adds one table of the relay ÷ nginx ratio per
framing, with every repeat's ratio.
"""

from __future__ import annotations

import json

# name -> (sim knobs, ask for include_usage, what it is)
FRAMINGS = {
    "paced-vllm": ({"shape": "vllm"}, True, "vLLM's chunks, usage: null on each"),
    "paced-openai": (
        {"shape": "openai"},
        True,
        "OpenAI's chunks: service_tier, usage: null, random obfuscation",
    ),
    "paced-events3": ({"events_per_chunk": 3}, False, "llama-server's, 3 events per chunk"),
    "paced-chunks3": ({"chunks_per_write": 3}, False, "llama-server's, 3 chunks per write"),
    "paced-openai-batch": (
        {"shape": "openai", "events_per_chunk": 2, "chunks_per_write": 2},
        True,
        "OpenAI's, 2 events per chunk, 2 chunks per write",
    ),
}
ABOUT = {
    "paced": "llama-server's chunks (the simulator's own), 1 event per read",
    "real-long": "the real llama-server, 500 tokens per stream, unpaced",
    **{k: v[2] for k, v in FRAMINGS.items()},
}


def scenarios(a, paced: dict) -> dict[str, dict]:
    out = {
        name: dict(
            paced, extra=["--sim-knobs", json.dumps(knobs)] + (["--include-usage"] if usage else [])
        )
        for name, (knobs, usage, _) in FRAMINGS.items()
    }
    # two streams at a time: the helper's llama-server has two slots (-np 2)
    out["real-long"] = dict(
        upstream="real",
        concurrency=2,
        requests=a.real_long_requests,
        max_tokens=500,
        interval_ms=0,
        ramp_s=0,
        extra=["--no-sim"],
    )
    return out


def summary(rows: list[dict], names: list[str]) -> str:
    """Markdown: per framing, relay and nginx CPU per event (medians), the ratio of the
    medians, and each repeat's ratio (relay ÷ nginx measured in the same repeat)."""
    lines = [
        "",
        "Per framing (relay ÷ nginx CPU per event; each repeat's ratio from that "
        "repeat's pair of runs):",
        "",
        "| framing | what | relay µs/event | nginx µs/event | ratio of medians "
        "| median of repeat ratios | each repeat |",
        "|---|---|---|---|---|---|---|",
    ]
    shown = False
    for name in names:
        per: dict[int, dict[str, float]] = {}
        for r in rows:
            if r.get("scenario") == name and r.get("proxy_cpu_us") and r.get("load"):
                ev = r["load"].get("events") or 0
                if ev:
                    per.setdefault(r["repeat"], {})[r["target"]] = r["proxy_cpu_us"] / ev
        pairs = [
            (v["relay"], v["nginx"])
            for _, v in sorted(per.items())
            if "relay" in v and "nginx" in v
        ]
        if not pairs:
            continue
        shown = True
        rel, ngx = _median([p[0] for p in pairs]), _median([p[1] for p in pairs])
        ratios = [p[0] / p[1] for p in pairs]
        lines.append(
            f"| {name} | {ABOUT.get(name, '')} | {rel:.2f} | {ngx:.2f} | "
            f"{rel / ngx:.2f}× | {_median(ratios):.2f}× | "
            + ", ".join(f"{x:.2f}×" for x in ratios)
            + " |"
        )
    return "\n".join(lines) + "\n" if shown else ""


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2
