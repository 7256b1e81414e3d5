"""What the relay tells about itself: logs, metrics, the request row, the operator page, what
it tells its service manager.

- `log`: structured log lines (one JSON object per line)
- `metrics`: per-upstream counters and gauges, as JSON and Prometheus text
- `metrics_merge`: the whole relay's figures added up from its worker processes' own
- `prom_histogram`: fixed-bucket latency histograms in Prometheus's shape
- `record`: what the relay knows about one request, written once as a row
- `row_timings`: a row's benchmark timings, computed once at settlement
- `ui_page`, `ui_state`, `static/`: the operator page (`GET /ui`) and what it shows
- `otel_env`, `otel_start`: whether OpenTelemetry is on, and the telemetry built at start
- `otel`, `otel_attrs`, `otel_export`: OpenTelemetry's spans and metrics (imported only when
  it is on), what a row says in the GenAI conventions, and how it all leaves the process
- `notify`: what systemd is told (`READY=1`, `RELOADING=1`, `STOPPING=1`) over `$NOTIFY_SOCKET`

May import: `relay.policy`, `relay.stream`, `relay.config`, `relay.http`, `relay.errors`.
"""
