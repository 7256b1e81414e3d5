"""Settlement: what a request used, written down exactly once on every exit path.

From the request's `Ledger`: release the slot, replace the budget reservation with actual
usage, write one request row (replacing its admission record, `store.admissions`), update
the metrics, log the access line. A request refused before it was read whole has no ledger:
`rejected` writes its row.
"""

from __future__ import annotations

import time

from relay.errors import RelayError
from relay.http.request_path import bounded, route_path
from relay.observe import row_timings as timing
from relay.observe.record import RESERVED, Record, user_agent
from relay.proxy import telemetry
from relay.proxy.exchange import Exchange
from relay.proxy.ledger import Ledger
from relay.stream import endings as E
from relay.stream.sse import SseScanner
from relay.stream.usage import Usage, stream_usage

# Refusals decided before any upstream is chosen or contacted (counted relay-wide).
ADMISSION_CODES = frozenset(
    {
        "invalid_api_key",
        "invalid_json",
        "bad_request",
        "model_not_found",
        "budget_exceeded",
        "not_found",
        "forbidden",
    }
)


def settle(app, client, rec: Record, ledger: Ledger, t0: float) -> None:
    """Release the slot, settle the budget, write the row and the access line: once."""
    ledger.release_slot()
    ex = ledger.exchange
    exact = None
    rec.total_ms = timing.round3((time.perf_counter() - t0) * 1000)
    rec.client_closed = client.gone and rec.outcome in (E.CLIENT_GONE, E.CLIENT_SLOW)
    served_ex = ex if ex is not None and rec.upstream_served is not None else None
    if served_ex is not None:
        rec.bytes_out = served_ex.bytes_out
        if served_ex.first_content_at is not None:
            rec.ttft_ms = timing.round3((served_ex.first_content_at - t0) * 1000)
        exact = _tokens(rec, served_ex, ledger)
        if served_ex.outcome == E.STALL:
            rec.error_code = f"stream_stall_{served_ex.stall_reason}"
            app.log.event(
                "stream_stall_guard_tripped",
                reason=served_ex.stall_reason,
                elapsed_s=served_ex.stall_elapsed,
                upstream=served_ex.upstream_name,
                request_id=rec.request_id,
            )
        elif rec.outcome not in (E.DONE, None):
            rec.error_code = rec.error_code or rec.outcome
        elif (
            isinstance(served_ex.scanner, SseScanner)
            and served_ex.scanner.error_first
            and not served_ex.scanner.content_events
        ):
            rec.outcome = rec.error_code = E.ERROR_EVENT  # a 200 that carried only an error
    rec.ok = rec.outcome == E.DONE and rec.status is not None and rec.status < 400
    hold = ledger.hold
    timing.fill(
        rec,
        t0,
        hold.first_out if hold is not None else None,
        served_ex.gaps if served_ex is not None else None,
        exact,
    )
    if rec.error_code is None and rec.status is not None and rec.status >= 400:
        rec.error_code = f"upstream_{rec.status}"
    res = ledger.reservation
    if res is not None:
        app.budgets.settle(res, *charge(rec), time.time())
    served = ledger.up or app.upstreams.get(rec.upstream_requested or "")
    trend = None  # the page's trend takes the requests an upstream was involved in
    if rec.error_code in ADMISSION_CODES or served is None:
        app.registry.rejected(rec.error_code or "unknown")  # no upstream involved
    else:
        m = served.metrics
        trend = ledger.generates  # /health, /v1/models, tokenize...: apart, in no latency figure
        if trend:
            m.request_done(rec.ok, rec.error_code)
            ttft, tpot, e2e = rec.ttft_ms, rec.tpot_ms, rec.e2e_ms
            m.observe_timings(
                None if ttft is None else ttft / 1000,
                None if tpot is None else tpot / 1000,
                None if e2e is None else e2e / 1000,
            )
        else:
            m.other_request_done()
        if ex is not None and ex.outcome == E.STALL and ex.stall_reason is not None:
            m.stall(ex.stall_reason)
    if rec.key_id is not None:
        app.registry.key_used(rec.key_id, rec.prompt_tokens, rec.completion_tokens)
    if app.otel is not None:  # OpenTelemetry on: the span ends, the metric points (once)
        telemetry.settled(app, rec, ledger, t0)
    app.keep(rec, ledger.admission, trend)  # the row replaces the admission, in one commit
    app.log.record("access", rec.log_fields())


def charge(rec: Record) -> tuple[int, int]:
    """What a settled request costs its key's budget: (requests, tokens), nothing unless an
    upstream served it."""
    if rec.upstream_served is None:
        return 0, 0
    return 1, rec.total_tokens


def _tokens(rec: Record, ex: Exchange, ledger: Ledger) -> Usage | None:
    """The row's tokens from what the exchange read (exact usage, counted events), else
    the reservation; the upstream's token figures follow."""
    scanner = ex.scanner
    exact = None
    approx = None
    if ex.body_copy is not None:
        # a body answering several prompts / choices: its usage may cover one of them
        # (llama-server's /v1/completions), so no usable figure - the reservation is charged
        if ex.outcome == E.DONE and ledger.completions <= 1:
            exact = ex.body_copy.usage()
    elif isinstance(scanner, SseScanner):
        exact = stream_usage(scanner.meta, scanner.meta_first) if scanner.meta else None
        approx = scanner.content_events
    if (
        exact is not None
        and exact.completion_tokens is None
        and exact.prompt_tokens is not None
        and ledger.completion_est == 0
    ):
        exact = Usage(exact.prompt_tokens, 0)  # embeddings / rerank: no completion tokens
    rec.set_tokens(exact, approx, ledger.prompt_est)
    if rec.tokens_source is None and ledger.generates and 200 <= ex.status < 300:
        # served, nothing counted (a body too big to keep, a body that is not JSON, ...):
        # unknown means reserved
        rec.set_reserved(ledger.prompt_est, ledger.completion_est)
    assert ledger.up is not None  # (an exchange was opened on it)
    metrics = ledger.up.metrics
    if exact is not None:
        metrics.set_flm(exact.decoding_speed_tps, exact.kv_occupancy_pct)
    if rec.completion_tokens is not None and rec.tokens_source != RESERVED:
        delta = rec.completion_tokens - ex.counted
        ex.counted = rec.completion_tokens
        metrics.add_tokens(delta, time.monotonic())
    return exact


def rejected(dispatcher, client, err: RelayError) -> None:
    """A request refused before it was read whole (400/408/413/431): a row all the same."""
    app = dispatcher.app
    head = client.head
    path = route_path(head.target) if head is not None else ""
    rid = (
        dispatcher.request_id(head.headers.raw_items()) if head is not None else dispatcher.new_id()
    )
    rec = Record(
        ts=time.time(),
        request_id=rid.decode(),
        path=path,
        method=bounded(head.method.decode("latin-1"), 32) if head is not None else "",
        status=err.status,
        error_code=err.code,
        outcome="rejected",
        client_addr=client.peer_host,
        user_agent=user_agent(head.headers) if head is not None else None,
    )
    if head is not None:  # the answer carries the CORS headers too (client.py writes it)
        err.headers = err.headers + app.cors.headers(head.headers.raw_items())
    app.registry.rejected(err.code)
    if app.otel is not None:  # its span begins and ends here
        app.otel.rejected(rec, head.headers.raw_items() if head is not None else ())
    app.keep(rec)
    app.log.record("access", rec.log_fields())
