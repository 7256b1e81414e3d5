"""Markdown report: machine header, side-by-side tables, key ratio."""

from __future__ import annotations

import datetime
import os
import platform
import statistics

from bench import nginx


def machine() -> list[str]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?"
            )
    except OSError:
        pass
    return [
        f"- date (UTC): {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M:%S}",
        f"- machine: {platform.machine()}, {cpu}, {os.cpu_count()} cores",
        f"- python: {platform.python_version()} ({platform.python_implementation()})",
        f"- nginx: {nginx.version()}",
    ]


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(x, nd=1, suffix=""):
    return "–" if x is None else f"{x:.{nd}f}{suffix}"


def _pct(x):
    return "–" if x is None else f"{x * 100:.0f}"


def _get(row, *path):
    v = row
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def _per(row, key, denom_path):
    d = _get(row, *denom_path)
    return row[key] / d if key in row and d else None


def brief(row: dict) -> str:
    if "skipped" in row:
        return row["skipped"]
    ld = row["load"]
    s = (
        f"req={ld['requests']} err={ld['errors']} incomplete={ld['incomplete']} "
        f"events={ld['events']} ttft_p50={_f(ld['ttft_ms']['p50'], 3)}ms "
        f"client_cpu={ld['client_cpu_frac'] * 100:.0f}%"
    )
    if "proxy_cpu_us" in row:
        s += f" proxy_us/event={_f(_per(row, 'proxy_cpu_us', ('load', 'events')), 2)}"
    if "nginx_upstream_errors" in row:
        s += f" nginx_upstream_errors={row['nginx_upstream_errors']}"
    return s + (f" [{'; '.join(ld['error_samples'])}]" if ld["error_samples"] else "")


def failures(rows) -> int:
    return sum(r["load"]["errors"] + r["load"]["incomplete"] for r in rows if "load" in r)


def _added(rows, r, pkey):
    """TTFT of r minus TTFT of direct in the same scenario and repeat."""
    d = next(
        (
            x
            for x in rows
            if x.get("target") == "direct"
            and "load" in x
            and x["scenario"] == r["scenario"]
            and x["repeat"] == r["repeat"]
        ),
        None,
    )
    a, b = _get(r, "load", "ttft_ms", pkey), d and _get(d, "load", "ttft_ms", pkey)
    return None if a is None or b is None else a - b


def _ratios_per_repeat(rows, scenario, target="relay", per: str = "events") -> list[float]:
    """`target` (relay) ÷ nginx CPU per event (or per request) within each repeat (the two
    ran one after the other): the spread shows how much the machine drifted between
    repeats."""
    out = []
    for rep in sorted({r["repeat"] for r in rows if r["scenario"] == scenario}):
        us = {
            r["target"]: _per(r, "proxy_cpu_us", ("load", per))
            for r in rows
            if r["scenario"] == scenario and r["repeat"] == rep and "load" in r
        }
        if us.get(target) and us.get("nginx"):
            out.append(us[target] / us["nginx"])
    return out


def aggregate(rows, scenario, target) -> dict | None:
    rs = [r for r in rows if r["scenario"] == scenario and r["target"] == target]
    if not rs:
        return None
    if "skipped" in rs[0]:
        return {"skipped": rs[0]["skipped"]}
    L = lambda *p: _med([_get(r, "load", *p) for r in rs])  # noqa: E731
    return {
        "n": len(rs),
        "requests": L("requests"),
        "errors": sum(r["load"]["errors"] for r in rs),
        "incomplete": sum(r["load"]["incomplete"] for r in rs),
        "events": L("events"),
        "us_event": _med([_per(r, "proxy_cpu_us", ("load", "events")) for r in rs]),
        "us_req": _med([_per(r, "proxy_cpu_us", ("load", "requests")) for r in rs]),
        "sim_us_event": _med([_per(r, "sim_cpu_us", ("load", "events")) for r in rs]),
        "rss_mib": _med([r.get("proxy_hwm_kb", 0) / 1024 or None for r in rs]),
        "p50": L("ttft_ms", "p50"),
        "p99": L("ttft_ms", "p99"),
        "add50": _med([_added(rows, r, "p50") for r in rs]),
        "add99": _med([_added(rows, r, "p99") for r in rs]),
        "rate_mean": L("rate_tps", "mean"),
        "rate_min": L("rate_tps", "min"),
        "rate_p50": L("rate_tps", "p50"),
        "stream_tps": L("stream_tps", "p50"),
        "stream_tps_low": L("stream_tps", "p99_low"),
        "throughput": L("throughput_tps"),
        "rate_target": L("rate_tps", "target"),
        "late": L("rate_tps", "late"),
        "gap_max": L("max_gap_ms", "max"),
        "client_cpu": L("client_cpu_frac"),
        "wall": L("wall_s"),
        "other_cpu": _med([r.get("other_cpu_frac") for r in rs]),
        "samples": sorted({s for r in rs for s in r["load"]["error_samples"]}),
    }


def real_table(aggs, targets) -> list[str]:
    """--real: the figures a llama-server user compares - TTFT and tokens/s per target."""
    out = [
        "",
        "TTFT and tokens/s against the real llama-server (medians over streams; same run):",
        "",
        "| target | TTFT p50 ms | TTFT p99 ms | added TTFT p50 ms | added TTFT p99 ms"
        " | tok/s per stream p50 (request → last token) | slowest stream tok/s"
        " | decode tok/s p50 (first → last token) | aggregate tok/s (all tokens ÷ wall) |",
        "|" + "---|" * 9,
    ]
    for t in targets:
        g = aggs.get(("real", t))
        if not g or "skipped" in g:
            out.append(f"| {t} | {g['skipped'] if g else 'not run'} |" + " |" * 7)
            continue
        proxy = t != "direct"
        out.append(
            "| "
            + " | ".join(
                [
                    t,
                    _f(g["p50"], 3),
                    _f(g["p99"], 3),
                    _f(g["add50"], 3) if proxy else "–",
                    _f(g["add99"], 3) if proxy else "–",
                    _f(g["stream_tps"], 0),
                    _f(g["stream_tps_low"], 0),
                    _f(g["rate_p50"], 0),
                    _f(g["throughput"], 0),
                ]
            )
            + " |"
        )
    out += [
        "",
        "tok/s per stream = content tokens ÷ (request written → last content event), so "
        "it includes TTFT; decode tok/s leaves the first token out and is sensitive to a "
        "proxy delivering several events in one read (a burst makes first → last short); "
        "aggregate = all content tokens of the run ÷ its wall time, connection set-up "
        "included.",
    ]
    return out


def render(rows, scs, names, targets, a, upstream_kind) -> str:
    out = (
        ["# relay benchmark: direct vs relay vs nginx", ""]
        + machine()
        + [
            f"- upstream: {upstream_kind}; repeats: {a.repeat} (figures are medians)"
            f"{'; --quick' if a.quick else ''}",
            "- load client: separate process, "
            + "/".join(sorted({r["load"].get("loop", "?") for r in rows if "load" in r}) or ["?"])
            + " event loop, raw sockets, one connection per stream",
            "",
        ]
    )
    for name in names:
        sc = scs[name]
        out.append(
            f"- **{name}**: {sc['concurrency']} concurrent, {sc['requests']} requests, "
            f"max_tokens {sc['max_tokens']}, interval {sc['interval_ms']} ms, "
            f"ramp {sc['ramp_s']} s, new connection per request"
        )
    up_label = "sim" if upstream_kind == "simulator" else upstream_kind
    out += [
        "",
        "| scenario | target | requests | errors | incomplete | events | proxy CPU µs/event"
        f" | proxy CPU µs/request | proxy peak RSS MiB | {up_label} CPU µs/event | TTFT p50 ms"
        " | TTFT p99 ms | added TTFT p50 ms | added TTFT p99 ms |",
        "|" + "---|" * 14,
    ]
    aggs = {}
    for name in names:
        for t in targets:
            g = aggs[name, t] = aggregate(rows, name, t)
            if g is None:
                continue
            if "skipped" in g:
                out.append(f"| {name} | {t} | {g['skipped']} |" + " |" * 11)
                continue
            proxy = t != "direct"
            out.append(
                "| "
                + " | ".join(
                    [
                        name,
                        t,
                        str(g["requests"]),
                        str(g["errors"]),
                        str(g["incomplete"]),
                        _f(g["events"], 0),
                        _f(g["us_event"], 2) if proxy else "–",
                        _f(g["us_req"], 1) if proxy else "–",
                        _f(g["rss_mib"], 1) if proxy else "–",
                        _f(g["sim_us_event"], 2),
                        _f(g["p50"], 3),
                        _f(g["p99"], 3),
                        _f(g["add50"], 3) if proxy else "–",
                        _f(g["add99"], 3) if proxy else "–",
                    ]
                )
                + " |"
            )
    if "real" in names:
        out += real_table(aggs, targets)
    out += [
        "",
        "Load client health (events on time? client not the bottleneck?):",
        "",
        "| scenario | target | tok/s per stream mean (target) | min | late streams (<90%)"
        " | max inter-token gap ms | client CPU % | other CPU on machine % | wall s |",
        "|" + "---|" * 9,
    ]
    for (name, t), g in aggs.items():
        if g and "skipped" not in g:
            nd = 2 if (g["rate_target"] or 0) < 10 else 1
            out.append(
                f"| {name} | {t} | {_f(g['rate_mean'], nd)} ({_f(g['rate_target'], nd)}) | "
                f"{_f(g['rate_min'], nd)} | {_f(g['late'], 0)} | {_f(g['gap_max'], 1)} | "
                f"{_pct(g['client_cpu'])} | {_pct(g['other_cpu'])} | {_f(g['wall'], 1)} |"
            )
    out.append("")
    for name, who in [
        (n, t) for n in names for t in ("relay", "relay_ui", "relay_otel", "baseline")
    ]:
        r, n = aggs.get((name, who)), aggs.get((name, "nginx"))
        if (
            r
            and n
            and "skipped" not in r
            and "skipped" not in n
            and r["us_event"]
            and n["us_event"]
        ):
            per = _ratios_per_repeat(rows, name, who)
            label = {
                "relay": "relay",
                "relay_ui": "relay with the operator page open (polled 1/s)",
                "relay_otel": "relay with OpenTelemetry on (OTLP/HTTP to a local sink)",
            }.get(who, f"baseline relay ({a.baseline or 'HEAD'})")
            out.append(
                f"**{'Key ratio' if name == 'paced' else 'Ratio'} ({name}): {label} CPU per event "
                f"÷ nginx CPU per event = {r['us_event'] / n['us_event']:.2f}×** "
                f"({r['us_event']:.2f} µs vs {n['us_event']:.2f} µs)"
                + (
                    f"; repeat by repeat: {', '.join(f'{x:.2f}×' for x in per)}"
                    if len(per) > 1
                    else ""
                )
            )
            if name.startswith(("tls", "keep", "ttft")) and r["us_req"] and n["us_req"]:
                per = _ratios_per_repeat(rows, name, who, "requests")
                out.append(
                    f"**Ratio ({name}): {label} CPU per request ÷ nginx CPU per request = "
                    f"{r['us_req'] / n['us_req']:.2f}×** ({r['us_req']:.1f} µs vs "
                    f"{n['us_req']:.1f} µs)"
                    + (
                        f"; repeat by repeat: {', '.join(f'{x:.2f}×' for x in per)}"
                        if len(per) > 1
                        else ""
                    )
                )
        elif r and n and "skipped" in n:
            out.append(f"Ratio ({name}): relay vs nginx n/a ({n['skipped']})")
    for sfx in ("", "-req"):
        for t in ("relay", "nginx"):
            a_, b_ = aggs.get((f"tls{sfx}", t)), aggs.get((f"keep{sfx}", t))
            if a_ and b_ and "skipped" not in a_ and "skipped" not in b_ and a_["us_event"]:
                out.append(
                    f"What TLS costs {t} (tls{sfx} − keep{sfx}, same load): "
                    f"{a_['us_event'] - b_['us_event']:+.2f} µs/event, "
                    f"{a_['us_req'] - b_['us_req']:+.1f} µs/request"
                )
    total = sum(g["errors"] + g["incomplete"] for g in aggs.values() if g and "skipped" not in g)
    out += [
        "",
        f"Errors + incomplete streams, all targets and repeats: **{total}** "
        "(the errors/incomplete columns are summed over repeats, the rest are medians)",
    ]
    for (name, t), g in aggs.items():
        if g and g.get("samples"):
            out.append(f"- {name}/{t}: {'; '.join(g['samples'])}")
    restarts = sum(r.get("upstream_restarts", 0) for r in rows)
    if restarts:
        out.append(
            f"- the upstream died during {restarts} measurement(s) (see stderr); "
            "they were discarded and measured again after a restart"
        )
    ng = {
        name: sum(r.get("nginx_upstream_errors", 0) for r in rows if r["scenario"] == name)
        for name in names
    }
    if any(ng.values()):
        out.append(
            "- nginx upstream errors logged (stale pooled keep-alive connections, retried "
            "via `proxy_next_upstream ... non_idempotent`): "
            + ", ".join(f"{k} {v}" for k, v in ng.items())
        )
    out += [
        "",
        "Notes: CPU = utime+stime from /proc/<pid>/stat of the proxy process tree "
        "(relay; nginx master+worker) sampled just before and after the load client ran; "
        "events = all SSE events the client received (role, content, finish, [DONE]); "
        "TTFT = request about to be written → first content event; added TTFT = target − direct in the "
        "same repeat; CPU resolution is one clock tick (10 ms at 100 Hz) per window; peak RSS = VmHWM of a fresh proxy process per scenario; the load "
        "client is a separate process (one asyncio loop) — if its CPU % nears 100 or "
        "streams run late, the figures are load-client-bound; other CPU is the machine's busy time not used by sim, proxy or client, over all cores (noise from other work).",
        "",
    ]
    return "\n".join(out)
