"""What the relay tells about itself: logs, metrics, the request row, the operator page.

- `log`: structured log lines (one JSON object per line)
- `metrics`: per-upstream counters and gauges, as JSON and Prometheus text
- `prom_histogram`: fixed-bucket latency histograms in Prometheus's shape
- `record`: what the relay knows about one request, written once as a row
- `row_timings`: a row's benchmark timings, computed once at settlement
- `ui_page`, `ui_state`, `static/`: the operator page (`GET /ui`) and what it shows

May import: `relay.policy`, `relay.stream`, `relay.config`, `relay.http`, `relay.errors`.
"""
