"""`relay report --bench`: the figures benchmarking tools print, computed from stored rows.

Pure: rows in (dicts of the `request` table), groups out. Definitions follow vLLM's
`vllm bench serve` (docs/benchmarking.md):

- only requests that generate enter it: the relay's own endpoints, `GET /health`,
  `/v1/models`, `/props`, tokenize and the other routes that generate nothing
  (`admission.generates`) are left out unless asked for (`--all`);
- only successful requests (`ok = 1`) enter the latency figures and throughputs, as vLLM
  counts only completed requests;
- TTFT (`ttft_ms`), TPOT (`tpot_ms` = (E2EL - TTFT) / (output tokens - 1)), E2EL (`e2e_ms`):
  mean and p50/p90/p99 over the requests, percentiles interpolated linearly between the two
  nearest values (numpy's default, which vLLM uses);
- ITL: every gap between content events of every request, pooled (vLLM's ITL; AIPerf and
  GenAI-Perf call this figure's per-request mean "ITL" and vLLM's TPOT "inter token
  latency"): from the rows' gap buckets (`itl_hist`), each gap read as its bucket's midpoint
  (within 2%);
- duration: the span of the group's requests in the window asked for (`--since` up to now,
  or `--from`..`--to`), from the first one's start to the last one's end, as a benchmark
  client times its run (`window_s`: the window itself); request throughput = completed
  requests / duration, output throughput = their completion tokens / duration; goodput = completed requests meeting every given SLO / duration (vLLM's
  `--goodput ttft:..,tpot:..,e2el:..`; a request of one token has TPOT 0 there and here; a
  request with no TTFT, not streamed, does not meet a TTFT SLO);
- the prompt cache (`prompt_cache`): each group's prompt tokens sent to a pool, the part
  reused from the cache, and the hit ratio, over all its requests of a pool
  (report.prompt_cache); `--by pool` groups by the pool.
"""

from __future__ import annotations

import csv
import io
import math
import re
from typing import Literal, NotRequired, TypedDict

from relay.policy.admission import generates
from relay.report import prompt_cache as cache
from relay.report.untrusted import printable
from relay.stream import itl as gaps


class BenchRow(TypedDict, total=False):
    """A stored row as the benchmark view reads it (a hand-made one may leave columns out)."""

    ts: float
    key_id: str | None
    model: str | None
    upstream_served: str | None
    ok: int | None
    stream: int | None
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    itl_hist: str | None
    completion_tokens: int | None
    prompt_tokens: int | None
    tokens_source: str | None
    method: str | None
    path: str | None
    total_ms: float | None
    pool: str | None
    cached_tokens: int | None


class Stats(TypedDict):
    """One figure over a group's requests, in ms; `n`: the values it is made of."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    n: int


class BenchGroup(TypedDict):
    """One group's figures (or the total's). The SLO keys only when SLOs were given."""

    group: str | None
    requests: int
    completed: int
    failed: int
    duration_s: float
    window_s: float
    request_throughput: float | None
    output_throughput: float | None
    output_tokens: int
    ttft: Stats
    tpot: Stats
    e2el: Stats
    itl: Stats
    prompt_cache: cache.Hits
    slo: NotRequired[dict[str, float]]
    good: NotRequired[int]
    goodput: NotRequired[float | None]


# The columns a group is named by, and those timed in ms.
GroupColumn = Literal["model", "upstream_served", "key_id", "pool"]
TimeColumn = Literal["ttft_ms", "tpot_ms", "e2e_ms"]
Figure = Literal["ttft", "tpot", "itl", "e2el"]
Stat = Literal["mean", "p50", "p90", "p99"]
# What `--by` groups on: the column of each choice.
BY: dict[str, GroupColumn] = {
    "model": "model",
    "upstream": "upstream_served",
    "key": "key_id",
    "pool": "pool",
}
# The columns the view reads: its row's, in order.
READ_COLUMNS = tuple(BenchRow.__annotations__)
SLO_NAMES: dict[str, TimeColumn] = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}
FIGURES: tuple[Figure, ...] = ("ttft", "tpot", "itl", "e2el")
STATS: tuple[Stat, ...] = ("mean", "p50", "p90", "p99")


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=500ms,tpot=50ms,e2el=2s` -> {"ttft": 500.0, ...} in ms (a bare number is ms,
    as in vLLM's --goodput)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(ttft|tpot|e2el)\s*[=:]\s*(\d+(?:\.\d+)?)\s*(ms|s)?", part.lower())
        if not m:
            raise ValueError(f"bad --slo part {part!r}: use e.g. ttft=500ms,tpot=50ms,e2el=10s")
        out[m.group(1)] = float(m.group(2)) * (1000.0 if m.group(3) == "s" else 1.0)
    if not out:
        raise ValueError("--slo names no figure")
    return out


def interpolated_percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    v = sorted(values)
    if not v:
        return None
    pos = (len(v) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _stats(values: list[float]) -> Stats:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": interpolated_percentile(values, 50),
        "p90": interpolated_percentile(values, 90),
        "p99": interpolated_percentile(values, 99),
        "n": len(values),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _itl_stats(rows: list[BenchRow]) -> Stats:
    buckets: dict[int, int] = {}
    zeros = 0
    for r in rows:
        _, z = gaps.decode(r.get("itl_hist"), buckets)
        zeros += z
    n = zeros + sum(buckets.values())
    mean = None
    if n:
        mean = sum(c * sum(gaps.bucket_bounds(k)) / 2 for k, c in buckets.items()) / n * 1000
    return {
        "mean": mean,
        "p50": _ms(gaps.quantile_of(buckets, zeros, 0.5)),
        "p90": _ms(gaps.quantile_of(buckets, zeros, 0.9)),
        "p99": _ms(gaps.quantile_of(buckets, zeros, 0.99)),
        "n": n,
    }


def _values(rows: list[BenchRow], col: TimeColumn) -> list[float]:
    """A column's values over rows that have one."""
    return [v for r in rows if (v := r.get(col)) is not None]


def meets(row: BenchRow, slo: dict[str, float]) -> bool:
    """Whether a request meets every SLO. vLLM counts TPOT 0 for a single output token."""
    for name, limit in slo.items():
        value = row.get(SLO_NAMES[name])
        if value is None:
            if name == "tpot" and (row.get("completion_tokens") or 0) <= 1:
                continue
            return False
        if value > limit:
            return False
    return True


def generating(row: BenchRow) -> bool:
    """A request that can make the upstream generate (a row that does not say: kept)."""
    method, path = row.get("method"), row.get("path")
    if not method or path is None:
        return True
    return generates(method.encode(), path)


def span(rows: list[BenchRow]) -> float:
    """Seconds from the first request's start to the last one's end (0 with none)."""
    if not rows:
        return 0.0
    first = min(r["ts"] for r in rows)
    last = max(r["ts"] + (r.get("total_ms") or 0.0) / 1000.0 for r in rows)
    return max(0.0, last - first)


def bench_group(
    rows: list[BenchRow], window_s: float, slo: dict[str, float] | None, group: str | None
) -> BenchGroup:
    """One group's figures. A reservation charged is no count of output tokens."""
    done = [r for r in rows if r.get("ok")]
    duration_s = span(rows) if rows and all("ts" in r for r in rows) else window_s
    out_tokens = sum(
        r.get("completion_tokens") or 0 for r in done if r.get("tokens_source") != "reserved"
    )
    out: BenchGroup = {
        "group": group,
        "requests": len(rows),
        "completed": len(done),
        "failed": len(rows) - len(done),
        "duration_s": duration_s,
        "window_s": window_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "output_tokens": out_tokens,
        "ttft": _stats(_values(done, "ttft_ms")),
        "tpot": _stats(_values(done, "tpot_ms")),
        "e2el": _stats(_values(done, "e2e_ms")),
        "itl": _itl_stats(done),
        "prompt_cache": cache.hits(rows),
    }
    if slo:
        good = sum(1 for r in done if meets(r, slo))
        out["slo"] = dict(slo)
        out["good"] = good
        out["goodput"] = good / duration_s if duration_s > 0 else None
    return out


def bench(
    rows: list[BenchRow],
    by: str,
    window_s: float,
    slo: dict[str, float] | None = None,
    everything: bool = False,
) -> tuple[list[BenchGroup], BenchGroup]:
    """(one summary per group, ordered by name; the summary of all rows): the requests that
    generate, or `everything`. `window_s`: the window asked for."""
    if not everything:
        rows = [r for r in rows if generating(r)]
    col = BY[by]
    members: dict[str | None, list[BenchRow]] = {}
    for r in rows:
        members.setdefault(r.get(col), []).append(r)
    keyed = sorted(members, key=lambda k: (k is None, k or ""))
    return (
        [bench_group(members[k], window_s, slo, k) for k in keyed],
        bench_group(rows, window_s, slo, "TOTAL"),
    )


# ---- rendering -------------------------------------------------------------------------
# A value of a flat record (a CSV cell, a table cell).
Cell = str | int | float | None


def flat(s: BenchGroup) -> dict[str, Cell]:
    """One group as a flat record (CSV columns, table cells)."""
    out: dict[str, Cell] = {
        "group": s["group"],
        "requests": s["requests"],
        "completed": s["completed"],
        "failed": s["failed"],
        "duration_s": s["duration_s"],
        "request_throughput": s["request_throughput"],
        "output_throughput": s["output_throughput"],
        "output_tokens": s["output_tokens"],
    }
    for f in FIGURES:
        for st in STATS:
            out[f"{f}_{st}_ms"] = s[f][st]
    hits = s["prompt_cache"]
    out["prompt_cache_requests"] = hits["requests"]
    out["prompt_cache_prompt_tokens"] = hits["prompt_tokens"]
    out["prompt_cache_cached_tokens"] = hits["cached_tokens"]
    out["prompt_cache_hit_ratio"] = hits["hit_ratio"]
    if "goodput" in s:
        out["good"] = s["good"]
        out["goodput"] = s["goodput"]
    return out


def _csv_cell(v: Cell) -> str | int | float:
    """A cell as CSV writes it: text escaped as the other forms print it (a CSV is read in
    a terminal too, and a quoted line end still starts a line there)."""
    if v is None:
        return ""
    return printable(v) if isinstance(v, str) else v


def render_csv(groups: list[BenchGroup], total: BenchGroup) -> str:
    """One line per group, then the total's; text escaped."""
    records = [flat(g) for g in groups] + [flat(total)]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(records[0]), lineterminator="\n")
    w.writeheader()
    for r in records:
        w.writerow({k: _csv_cell(v) for k, v in r.items()})
    return buf.getvalue()


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render_text(groups: list[BenchGroup], total: BenchGroup, by: str) -> str:
    """Each group's figures as lines of text, then the total's; names escaped. Times in ms."""
    lines = []
    for s in groups + [total]:
        name = printable(s["group"]) if s["group"] is not None else "-"
        head = f"{by} {name}" if s is not total else "TOTAL"
        lines.append(
            f"== {head}: {s['completed']} completed, {s['failed']} failed, "
            f"over {s['duration_s']:.1f} s"
        )
        lines.append(
            f"   request throughput {_num(s['request_throughput'], 3)} req/s, "
            f"output {_num(s['output_throughput'], 2)} tok/s"
            + (
                f", goodput {_num(s['goodput'], 3)} req/s ({s['good']} met the SLOs)"
                if "goodput" in s
                else ""
            )
        )
        hits = s["prompt_cache"]
        if hits["requests"]:
            lines.append(
                f"   prompt cache {cache.percent(hits['hit_ratio'])} hit: "
                f"{hits['cached_tokens']} of {hits['prompt_tokens']} prompt tokens cached "
                f"({hits['requests']} request{'s' if hits['requests'] != 1 else ''} to a pool)"
            )
        lines.append("   ms        mean      p50      p90      p99")
        for f in FIGURES:
            st = s[f]
            lines.append(f"   {f.upper():<6}" + "".join(f"{_num(st[k]):>9}" for k in STATS))
    if any(s["prompt_cache"]["requests"] for s in groups + [total]):
        lines.append(cache.LEGEND)
    return "\n".join(lines) + "\n"
