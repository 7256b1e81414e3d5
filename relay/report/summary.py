"""`relay report`: per (model, upstream) latency, throughput and failure summary of stored rows,
then the prompt cache's hit ratio per pool (report.prompt_cache).

Aggregation (`aggregate`, `summarize`, `percentile`, `tokens_per_s`) is pure; `main` does the
I/O: parse flags, read rows read-only (a SQLite file or the shared PostgreSQL table:
report.rows), print a table or JSON. Stored text is printed escaped and a row whose columns
do not hold what the schema says is left out, named on stderr (report.untrusted).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, TypedDict, cast

from relay.config import ConfigError, in_file, load_config, parse_config, store_connect
from relay.report import bench as benchview
from relay.report import prompt_cache as cache
from relay.report import rows as stored
from relay.report.untrusted import BadRow, checked, printable


class SummaryRow(TypedDict, total=False):
    """A stored row as the summary reads it (a hand-made one may leave columns out)."""

    model: str | None
    upstream_served: str | None
    status: int | None
    ok: int | None
    error_code: str | None
    stream: int | None
    queue_ms: float | None
    ttft_ms: float | None
    total_ms: float | None
    completion_tokens: int | None
    tokens_source: str | None
    pool: str | None
    prompt_tokens: int | None
    cached_tokens: int | None


class Group(TypedDict):
    """One (model, upstream) group's numbers, or the total's; times in ms."""

    model: str | None
    upstream: str | None
    requests: int
    ok: int
    failed: int
    failures: dict[str, int]
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    tok_s_p50: float | None
    queue_p95_ms: float | None
    completion_tokens: int
    tokens_exact: int
    tokens_approx: int


@dataclass(frozen=True, slots=True)
class ReportArgs:
    """The command line, as `_parser` reads it."""

    db: str | None
    config: str | None
    since: str
    json: bool
    bench: bool
    by: str | None
    from_ts: str | None
    to_ts: str | None
    slo: str | None
    csv: bool
    all: bool

    def wants_bench(self) -> bool:
        """Whether a flag of the benchmark view was given."""
        return bool(
            self.bench or self.by or self.from_ts or self.to_ts or self.slo or self.csv or self.all
        )


# The columns the summary reads: its row's, in order.
READ_COLUMNS = tuple(SummaryRow.__annotations__)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str) -> float | None:
    """`30m`, `1h`, `24h`, `7d` (also `s`, fractions) -> seconds; `all` -> None."""
    text = text.strip().lower()
    if text == "all":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bad --since {text!r}: use e.g. 30m, 1h, 24h, 7d or all")
    return float(m.group(1)) * _UNITS[m.group(2)]


def percentile(values: Iterable[float], p: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least p% of values <= it."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = math.ceil(round(p * len(ordered) / 100.0, 9))
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def tokens_per_s(row: SummaryRow) -> float | None:
    """Decode rate of a streamed ok row: completion tokens over the time after the first token."""
    tokens, ttft, total = row.get("completion_tokens"), row.get("ttft_ms"), row.get("total_ms")
    if not row.get("stream") or not row.get("ok") or not tokens or tokens <= 0:
        return None
    if ttft is None or total is None or total <= ttft:
        return None
    return tokens / ((total - ttft) / 1000.0)


def failure_code(row: SummaryRow) -> str:
    if row.get("error_code"):
        return str(row["error_code"])
    return f"http_{row['status']}" if row.get("status") else "unknown"


def summarize(
    rows: list[SummaryRow], model: str | None = None, upstream: str | None = None
) -> Group:
    """One group's numbers (any subset of rows; the total line uses all of them)."""
    ok = sum(1 for r in rows if r.get("ok"))
    failures = Counter(failure_code(r) for r in rows if not r.get("ok"))
    ttft = [v for r in rows if (v := r.get("ttft_ms")) is not None]
    rates = [t for t in map(tokens_per_s, rows) if t is not None]
    queue = [v for r in rows if (v := r.get("queue_ms")) is not None]
    return {
        "model": model,
        "upstream": upstream,
        "requests": len(rows),
        "ok": ok,
        "failed": len(rows) - ok,
        "failures": dict(sorted(failures.items(), key=lambda kv: (-kv[1], kv[0]))),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p95_ms": percentile(ttft, 95),
        "ttft_p99_ms": percentile(ttft, 99),
        "tok_s_p50": percentile(rates, 50),
        "queue_p95_ms": percentile(queue, 95),
        "completion_tokens": sum(r.get("completion_tokens") or 0 for r in rows),
        "tokens_exact": sum(1 for r in rows if r.get("tokens_source") == "exact"),
        "tokens_approx": sum(1 for r in rows if r.get("tokens_source") == "approx"),
    }


def aggregate(rows: Iterable[SummaryRow]) -> list[Group]:
    """Rows grouped by (model, upstream_served), ordered by model then upstream."""
    members: dict[tuple[str | None, str | None], list[SummaryRow]] = {}
    for row in rows:
        members.setdefault((row.get("model"), row.get("upstream_served")), []).append(row)
    keys = sorted(members, key=lambda k: (k[0] or "", k[1] or ""))
    return [summarize(members[k], model=k[0], upstream=k[1]) for k in keys]


# ---- rendering -------------------------------------------------------------------------
_HEADERS = (
    "model",
    "upstream",
    "reqs",
    "ok",
    "fail",
    "ttft p50",
    "ttft p95",
    "ttft p99",
    "tok/s p50",
    "queue p95",
    "compl tok",
    "exact",
    "approx",
    "failures",
)
# The text columns; the rest are numbers, right-aligned.
_LEFT = {0, 1, 13}


_COUNTS: tuple[Literal["requests", "ok", "failed"], ...] = ("requests", "ok", "failed")
_MEASURES: tuple[
    Literal["ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "tok_s_p50", "queue_p95_ms"], ...
] = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "tok_s_p50", "queue_p95_ms")
_TOKENS: tuple[Literal["completion_tokens", "tokens_exact", "tokens_approx"], ...] = (
    "completion_tokens",
    "tokens_exact",
    "tokens_approx",
)


def _text(v: str | None) -> str:
    return "-" if v is None else printable(v)


def _measure(v: float | None) -> str:
    return "-" if v is None else f"{float(v):.1f}"


def _cells(g: Group) -> list[str]:
    failures = " ".join(f"{printable(code)}:{n}" for code, n in g["failures"].items())
    return [
        _text(g["model"]),
        _text(g["upstream"]),
        *(str(g[k]) for k in _COUNTS),
        *(_measure(g[k]) for k in _MEASURES),
        *(str(g[k]) for k in _TOKENS),
        failures or "-",
    ]


def render_table(groups: list[Group], total: Group | None = None) -> str:
    """Aligned plain text: one line per group, then a TOTAL line. Times in ms."""
    body = [_cells(g) for g in groups]
    foot = _cells({**total, "model": "TOTAL", "upstream": ""}) if total else None
    return _aligned(_HEADERS, _LEFT, body, foot)


def _aligned(
    headers: tuple[str, ...], left: set[int], body: list[list[str]], foot: list[str] | None
) -> str:
    """Columns under their headers, a rule below them and above the foot: the text columns
    (`left`) left-aligned, the numbers right-aligned; the last one's rule, of text, as wide as
    its header."""
    lines = [list(headers), *body, *([foot] if foot else [])]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]

    def fmt(cells: list[str]) -> str:
        out = [
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(out).rstrip()

    last = len(headers[-1]) if len(headers) - 1 in left else widths[-1]
    rule = "  ".join("-" * w for w in widths[:-1] + [last])
    text = [fmt(lines[0]), rule, *map(fmt, body)]
    if foot:
        text += [rule, fmt(foot)]
    return "\n".join(text) + "\n"


_POOL_HEADERS = ("pool", "reqs", "prompt tok", "cached tok", "hit")


def _pool_cells(name: str, h: cache.Hits) -> list[str]:
    return [
        name,
        str(h["requests"]),
        _count(h["prompt_tokens"]),
        _count(h["cached_tokens"]),
        cache.percent(h["hit_ratio"]),
    ]


def _count(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:.0f}"


def render_pools(pools: list[cache.PoolHits], total: cache.Hits) -> str:
    """The hit ratio per pool: its legend, one line per pool, then a TOTAL line; names
    escaped. Nothing when no row has a pool."""
    if not pools:
        return ""
    body = [_pool_cells(printable(p["pool"]), p) for p in pools]
    return cache.LEGEND + "\n" + _aligned(_POOL_HEADERS, {0}, body, _pool_cells("TOTAL", total))


# ---- I/O -------------------------------------------------------------------------------
def read_rows(db: stored.Db, since_ts: float | None) -> tuple[list[SummaryRow], list[BadRow]]:
    """(the rows since a time (None: all), those left out). They are SummaryRows: the SELECT
    names exactly its columns (and the row's id), and each holds what its column should."""
    sql = f"SELECT {stored.row_id(db.where)}, {_selected(db, READ_COLUMNS)} FROM request"
    params: tuple[float, ...] = ()
    if since_ts is not None:
        sql, params = sql + " WHERE ts >= ?", (since_ts,)
    rows, bad = checked(stored.fetch(db, sql, params), READ_COLUMNS, stored.ROW_ID)
    return cast("list[SummaryRow]", rows), bad


def _selected(db: stored.Db, columns: tuple[str, ...]) -> str:
    """The SELECT terms of `columns`: one the table lacks (a database no relay that has it
    opened yet; a report reads, never migrates) reads NULL."""
    have = stored.columns(db)
    return ", ".join(c if c in have else f"NULL AS {c}" for c in columns)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relay report", description="summarize stored request rows per model/upstream"
    )
    p.add_argument(
        "--db",
        help="SQLite file ([store].path, default relay.db) or "
        "postgresql://... ([store].url; password from PGPASSWORD); wins over --config",
    )
    p.add_argument(
        "--config",
        help="read the rows where this relay config file's [store] keeps them (its path, "
        "or its url with the password from its password_env)",
    )
    p.add_argument("--since", default="1h", help="30m, 1h, 24h, 7d or all (default 1h)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b = p.add_argument_group(
        "benchmark view",
        "TTFT, TPOT, ITL, E2EL (mean, p50, p90, p99), request and output "
        "token throughput and goodput over the window, as vLLM's `vllm bench serve` defines "
        "them (docs/benchmarking.md). Any of these flags selects it.",
    )
    b.add_argument("--bench", action="store_true", help="the benchmark view (grouped by model)")
    b.add_argument(
        "--by", choices=sorted(benchview.BY), help="group by model, upstream, key or pool"
    )
    b.add_argument(
        "--from",
        dest="from_ts",
        metavar="TIME",
        help="window start: unix seconds or ISO 8601 (UTC unless it says); instead of --since",
    )
    b.add_argument("--to", dest="to_ts", metavar="TIME", help="window end (default now)")
    b.add_argument(
        "--slo", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2el=10s (a bare number is ms)"
    )
    b.add_argument("--csv", action="store_true", help="print CSV (one line per group, then TOTAL)")
    b.add_argument(
        "--all",
        action="store_true",
        help="also the requests that generate nothing (/health, /v1/models, tokenize, admin)",
    )
    return p


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 date/time (UTC unless it carries an offset)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"bad time {text!r}: use unix seconds or ISO 8601") from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def window(args: ReportArgs, now: float) -> tuple[float | None, float]:
    """[start, end] of the rows asked for; start None: all rows."""
    end = parse_time(args.to_ts) if args.to_ts else now
    start: float | None
    if args.from_ts:
        start = parse_time(args.from_ts)
    else:
        since_s = parse_since(args.since)
        start = None if since_s is None else end - since_s
    if start is not None and end <= start:
        raise ValueError("the window ends before it starts")
    return start, end


def read_bench_rows(
    db: stored.Db, start: float | None, end: float
) -> tuple[list[benchview.BenchRow], list[BadRow]]:
    """(the rows of [start, end] (start None: up to end) for the benchmark view, those left
    out). A database no relay with the timing columns opened yet lacks them: they read NULL.
    They are BenchRows: the SELECT names exactly their columns (and the row's id), and each
    holds what its column should."""
    params: tuple[float, ...] = (end,) if start is None else (end, start)
    cols = _selected(db, benchview.READ_COLUMNS)
    sql = f"SELECT {stored.row_id(db.where)}, {cols} FROM request WHERE ts <= ?" + (
        "" if start is None else " AND ts >= ?"
    )
    rows, bad = checked(stored.fetch(db, sql, params), benchview.READ_COLUMNS, stored.ROW_ID)
    return cast("list[benchview.BenchRow]", rows), bad


def say(text: str) -> None:
    """A line on stderr, escaped as every line the report prints."""
    print(f"relay report: {printable(text)}", file=sys.stderr)


def skipped(bad: list[BadRow]) -> None:
    """One line on stderr for each row left out."""
    for row in bad:
        say(row.line())


def bench_main(args: ReportArgs, db: stored.Db, parser: argparse.ArgumentParser) -> int:
    try:
        start, end = window(args, time.time())
        slo = benchview.parse_slo(args.slo) if args.slo else None
    except ValueError as exc:
        parser.error(str(exc))
    try:
        rows, bad = read_bench_rows(db, start, end)
    except stored.errors() as exc:
        say(f"cannot read {stored.shown(db.where)!r}: {exc}")
        return 2
    skipped(bad)
    # All rows asked for: the window is the rows' own span.
    if start is None:
        start = min((r["ts"] for r in rows), default=end)
    by = args.by or "model"
    groups, total = benchview.bench(rows, by, end - start, slo, args.all)
    if args.json:
        print(
            json.dumps(
                {"from": start, "to": end, "by": by, "groups": groups, "total": total}, indent=2
            )
        )
    elif args.csv:
        print(benchview.render_csv(groups, total), end="")
    else:
        print(
            f"relay report: {printable(stored.shown(db.where))}, {len(rows)} requests from "
            f"{_iso(start)} to {_iso(end)}; times in ms"
        )
        print(benchview.render_text(groups, total, by), end="")
    return 0


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def source(args: ReportArgs, environ: Mapping[str, str] = os.environ) -> tuple[stored.Db, str]:
    """Where the rows are: `--db`, else the `[store]` of `--config` (a relative path read
    from the working directory, as the relay does), else relay.db; and a note for stderr
    when `--db` and `--config` are both given ("" otherwise). ConfigError naming the file."""
    if args.db is not None:
        note = f"--db given: the [store] of {args.config} is not read" if args.config else ""
        return stored.Db(args.db), note
    if args.config is None:
        return stored.Db("relay.db"), ""
    data = load_config(args.config)
    try:
        store = parse_config(data).store
        password = store_connect(store, environ).get("password") if store.url else None
    except ConfigError as exc:
        raise in_file(args.config, exc) from None
    return stored.Db(store.url or store.path, password), ""


def main(argv: list[str] | None = None) -> int:
    """`relay report`; its exit status (2: bad flags, nothing to read, a read failed). A bad
    flag exits at once (`parser.error`)."""
    parser = _parser()
    args = ReportArgs(**vars(parser.parse_args(argv)))
    try:
        since_s = parse_since(args.since)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        db, note = source(args)
    except ConfigError as exc:
        say(str(exc))
        return 2
    if note:
        say(note)
    why = stored.missing(db.where)
    if why is not None:
        say(why)
        return 2
    if args.wants_bench():
        return bench_main(args, db, parser)
    since_ts = None if since_s is None else time.time() - since_s
    try:
        rows, bad = read_rows(db, since_ts)
    except stored.errors() as exc:
        say(f"cannot read {stored.shown(db.where)!r}: {exc}")
        return 2
    skipped(bad)
    groups = aggregate(rows)
    total = summarize(rows, model="TOTAL")
    pools, pooled = cache.per_pool(rows), cache.hits(rows)
    if args.json:
        doc = {
            "since_s": since_s,
            "groups": groups,
            "total": total,
            "prompt_cache": {"pools": pools, "total": pooled},
        }
        print(json.dumps(doc, indent=2))
        return 0
    scope = "all rows" if since_s is None else f"last {args.since}"
    shown = printable(stored.shown(db.where))
    print(f"relay report: {shown}, {scope}, {len(rows)} requests; times in ms")
    print(render_table(groups, total), end="")
    if pools:
        print()
        print(render_pools(pools, pooled), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
