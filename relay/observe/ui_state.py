"""What the operator page (`GET /ui`) shows, kept off the body path.

- `Recent`: the last requests, a bounded ring fed once per request at settlement.
- `Trend`: per upstream, tokens/s and mean TTFT sampled every `step_s` by the relay's existing
  once-a-second token sampler (never by a stream), `points` samples kept (6 minutes).
- `state(app, ...)`: the JSON document of `/api/ui/state`, built only when someone asks.

Pure apart from reading the app's objects: tested without sockets.
"""

from __future__ import annotations

from collections import deque

RECENT_MAX = 100


def tokens_per_s(completion_tokens, ttft_ms, e2e_ms) -> float | None:
    """Decode rate of one streamed request: tokens after the first over the time after it."""
    if not completion_tokens or completion_tokens < 2 or ttft_ms is None or e2e_ms is None:
        return None
    span = (e2e_ms - ttft_ms) / 1000.0
    return round((completion_tokens - 1) / span, 2) if span > 0 else None


class Recent:
    def __init__(self, size: int = RECENT_MAX) -> None:
        self.ring: deque[tuple] = deque(maxlen=size)

    def add(self, rec) -> None:
        """One settled request (a `Record`): a tuple, turned into a dict only when read."""
        self.ring.append(
            (
                rec.ts,
                rec.request_id,
                rec.key_id,
                rec.model,
                rec.upstream_served or rec.upstream_requested,
                rec.status,
                rec.ttft_ms,
                rec.e2e_ms,
                rec.completion_tokens,
                rec.outcome,
                rec.error_code,
                rec.ok,
            )
        )

    def rows(self) -> list[dict]:
        """Newest first."""
        out = []
        for ts, rid, key, model, up, status, ttft, e2e, tokens, outcome, code, ok in reversed(
            self.ring
        ):
            out.append(
                {
                    "ts": ts,
                    "request_id": rid,
                    "key": key,
                    "model": model,
                    "upstream": up,
                    "status": status,
                    "ttft_ms": ttft,
                    "tokens_per_s": tokens_per_s(tokens, ttft, e2e),
                    "tokens": tokens,
                    "outcome": outcome if ok or not code else code,
                    "ok": bool(ok),
                }
            )
        return out


class Trend:
    def __init__(self, step_s: float = 5.0, points: int = 72) -> None:
        self.step_s = step_s
        self.points = points
        self.series: dict[str, deque] = {}
        self.next_at = 0.0

    def sample(self, wall: float, now: float, registry) -> None:
        """Called every second; keeps one point per `step_s` per upstream."""
        if wall < self.next_at:
            return
        self.next_at = wall + self.step_s
        for m in registry:
            s = self.series.get(m.name)
            if s is None:
                s = self.series[m.name] = deque(maxlen=self.points)
            _, ttft_avg = m.ttft(now)
            s.append(
                (
                    round(wall, 3),
                    round(m.tokens_per_sec(now), 3),
                    None if ttft_avg is None else round(ttft_avg * 1000, 3),
                )
            )

    def of(self, name: str) -> list[list]:
        return [list(p) for p in self.series.get(name, ())]


def budgets(config_keys, usage_of) -> list[dict]:
    """Per key and window: used against limits (0 = no limit); keys without limits too."""
    out = []
    for k in config_keys:
        limits = {
            "daily": (k.requests_per_day, k.tokens_per_day),
            "monthly": (k.requests_per_month, k.tokens_per_month),
        }
        used = usage_of(k.id)
        windows = []
        for kind, (req_limit, tok_limit) in limits.items():
            if not (req_limit or tok_limit):
                continue
            u = used.get(kind, {})
            windows.append(
                {
                    "window": kind,
                    "requests": u.get("requests", 0),
                    "requests_limit": req_limit,
                    "tokens": u.get("tokens", 0),
                    "tokens_limit": tok_limit,
                    "reserved_tokens": u.get("reserved_tokens", 0),
                }
            )
        out.append({"key": k.id, "windows": windows})
    return out


def state(app, wall: float, now: float) -> dict:
    ups = []
    for up in app.upstreams.values():
        up.refresh_metrics()
        snap = up.metrics.snapshot(now)
        ups.append(
            {
                **{
                    k: snap[k]
                    for k in (
                        "name",
                        "state",
                        "parallel",
                        "in_flight",
                        "queued",
                        "tokens_per_sec",
                        "ttft_avg_seconds",
                        "requests_total",
                        "requests_failed",
                        "tokens_total",
                        "stall_trips",
                    )
                },
                "trend": app.ui_trend.of(up.name),
            }
        )
    return {
        "now": wall,
        "step_s": app.ui_trend.step_s,
        "upstreams": ups,
        "recent": app.ui_recent.rows(),
        "budgets": budgets(app.config.key, lambda k: app.budgets.usage(k, wall)),
        "rows_dropped": app.store.rows_dropped,
    }
