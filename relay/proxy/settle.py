"""Settlement: what a request used, written down exactly once on every exit path.

From the request's `Ledger`: release the slot, decide how the request ended from the facts
recorded on the way (`policy.outcome`), replace the budget reservation with actual usage,
write one request row (replacing its admission record, `store.admissions`), update the
metrics, log the access line. A request refused before it was read whole has no ledger:
`rejected` writes its row.
"""

from __future__ import annotations

import time

from relay.errors import Code, Outcome, RelayError
from relay.http.fields import RequestHead
from relay.http.request_path import bounded, route_path
from relay.observe import row_timings as timing
from relay.observe.metrics import KeyOutcome
from relay.observe.record import RESERVED, Record, user_agent
from relay.observe.ui_state import Trended
from relay.policy.affinity import Reuse
from relay.policy.outcome import decide
from relay.proxy import telemetry
from relay.proxy.app_view import AppView
from relay.proxy.client_writer import ClientWriter
from relay.proxy.ledger import Ledger
from relay.stream.summary import ExchangeSummary
from relay.stream.usage import Usage

GENERATING, OTHER = Trended.GENERATING, Trended.OTHER
# The outcomes of a request the client left (gone, or too slow to read).
_CLIENT_LEFT = frozenset({Outcome.CLIENT_CLOSED, Outcome.CLIENT_WRITE_TIMEOUT})
# Refusals decided before any upstream is chosen or contacted (counted relay-wide).
ADMISSION_CODES = frozenset(
    {
        Code.INVALID_API_KEY,
        Code.INVALID_JSON,
        Code.BAD_REQUEST,
        Code.MODEL_NOT_FOUND,
        Code.BUDGET_EXCEEDED,
        Code.CONCURRENCY_EXCEEDED,
        Code.RATE_LIMIT_EXCEEDED,
        Code.NOT_FOUND,
        Code.FORBIDDEN,
    }
)


def settle(app: AppView, out: ClientWriter, rec: Record, ledger: Ledger, t0: float) -> None:
    """Release the slot, settle the budget, write the row and the access line: once. `out`:
    the client connection's writer (whether the client is gone, what the response's body
    took on the wire, when its first byte went out)."""
    ex = ledger.exchange
    summary = ex.summary if ex is not None else None
    ledger.release_slot(reuse_of(summary))
    verdict = decide(
        summary, ledger.content_out, ledger.answered, ledger.cut, ledger.drained, ledger.bug
    )
    rec.total_ms = timing.round3((time.perf_counter() - t0) * 1000)
    rec.outcome, rec.error_code, rec.status, rec.ok = (
        verdict.outcome,
        verdict.code,
        verdict.status,
        verdict.ok,
    )
    rec.client_closed = out.gone and verdict.outcome in _CLIENT_LEFT
    answered = ledger.answered
    if answered is not None and answered.reason is not None:
        rec.error = bounded(answered.reason)
    exact = None
    served = summary if verdict.served else None
    # The body bytes the client got, whoever wrote them: an upstream's, the relay's own
    # answer, heartbeats and an in-band error.
    rec.bytes_out = out.sent
    if served is not None:
        rec.upstream_served = served.upstream
        if served.first_content_at is not None:
            rec.ttft_ms = timing.round3((served.first_content_at - t0) * 1000)
        exact = _tokens(rec, served, ledger)
        if exact is not None and exact.refused:
            _untrusted(app, rec, served.upstream, exact)
        if served.stall is not None:
            app.log.event(
                "stream_stall_guard_tripped",
                reason=served.stall.reason,
                elapsed_s=served.stall.elapsed_s,
                upstream=served.upstream,
                request_id=rec.request_id,
            )
    timing.fill(rec, t0, out.first_at, served.gaps if served is not None else None, exact)
    res = ledger.reservation
    if res is not None:
        app.budgets.spend(res, *charge(rec), time.time())
    trend = _metrics(app, rec, ledger, summary)
    if rec.key_id is not None:
        # Served: what the key's budget counts as a request (`charge`).
        outcome = KeyOutcome.SERVED if charge(rec)[0] else KeyOutcome.REFUSED
        app.registry.key_used(rec.key_id, outcome, rec.prompt_tokens, rec.completion_tokens)
    if rec.pool is not None and rec.prompt_tokens is not None and rec.upstream_served:
        app.registry.pool_used(rec.pool, rec.prompt_tokens, rec.cached_tokens)
    if app.otel is not None:
        # OpenTelemetry on: the span ends, the metric points are recorded (once).
        telemetry.settled(app.otel, rec, ledger, summary, out.first_at)
    # The row replaces the admission record, in one commit.
    app.put_row(rec, ledger.admission, trend)
    app.log.record("access", rec.log_fields())


def _metrics(app: AppView, rec: Record, ledger: Ledger, summary: ExchangeSummary | None) -> Trended:
    """The upstream's figures of a settled request; how the page's trend takes it."""
    up = ledger.up or app.upstreams.get(rec.upstream_requested or "")
    if rec.error_code in ADMISSION_CODES or up is None:
        app.registry.rejected(rec.error_code or "unknown")
        return Trended.NONE
    m = up.metrics
    # /health, /v1/models, tokenize...: counted apart, in no latency figure.
    if ledger.generates:
        m.request_done(rec.ok, rec.error_code)
        ttft, tpot, e2e = rec.ttft_ms, rec.tpot_ms, rec.e2e_ms
        m.observe_timings(
            None if ttft is None else ttft / 1000,
            None if tpot is None else tpot / 1000,
            None if e2e is None else e2e / 1000,
        )
    else:
        m.other_request_done()
    if summary is not None and summary.stall is not None:
        m.stall(summary.stall.reason)
    return GENERATING if ledger.generates else OTHER


def reuse_of(summary: ExchangeSummary | None) -> Reuse | None:
    """What an exchange's answer said of its member's prompt cache, when it served (a 2xx
    with content or figures: the member read the prompt); None when it did not."""
    if summary is None or not 200 <= summary.status < 300:
        return None
    usage = summary.usage
    if usage is None or usage.refused:
        return _SERVED if summary.first_content_at is not None else None
    return Reuse(usage.prompt_tokens, usage.cached_tokens, usage.prompt_ms)


_SERVED = Reuse()


def charge(rec: Record) -> tuple[int, int]:
    """What a settled request costs its key's budget: (requests, tokens), nothing unless an
    upstream served it."""
    if rec.upstream_served is None:
        return 0, 0
    return 1, rec.total_tokens


def _tokens(rec: Record, ex: ExchangeSummary, ledger: Ledger) -> Usage | None:
    """The row's tokens from what the exchange read (exact usage, counted events), else
    the reservation; the upstream's token figures follow."""
    exact = None
    approx = None
    if ex.sse:
        exact = ex.usage
        approx = ex.content_events
    elif ledger.completions <= 1:
        # A body answering several prompts or choices may give the usage of one of them
        # (llama-server's /v1/completions): no usable figure then, the reservation is
        # charged.
        exact = ex.usage
    # Figures that were no plausible count are not charged: what was counted or reserved is.
    untrusted = exact is not None and bool(exact.refused)
    if (
        exact is not None
        and exact.completion_tokens is None
        and exact.prompt_tokens is not None
        and ledger.completion_est == 0
    ):
        # Embeddings and rerank: no completion tokens.
        exact = Usage(exact.prompt_tokens, 0, cached_tokens=exact.cached_tokens)
    rec.set_tokens(None if untrusted else exact, approx, ledger.prompt_est)
    if rec.tokens_source is None and ledger.generates and 200 <= ex.status < 300:
        # Served, nothing counted (a body too big to keep, a body that is not JSON, ...):
        # unknown means reserved.
        rec.set_reserved(ledger.prompt_est, ledger.completion_est)
    # The completion tokens counted or told (a reservation is neither).
    measured = rec.completion_tokens if rec.tokens_source != RESERVED else None
    if untrusted:
        rec.set_untrusted()
    up = ledger.up
    assert up is not None
    metrics = up.metrics
    if exact is not None:
        metrics.set_flm(exact.decoding_speed_tps, exact.kv_occupancy_pct)
    if measured is not None:
        metrics.add_tokens(measured - ex.counted, time.monotonic())
    return exact


def _untrusted(app: AppView, rec: Record, upstream: str, exact: Usage) -> None:
    """The one line of a request whose upstream sent figures that were no plausible count:
    which, and why (no value: a string figure could hold anything)."""
    app.log.event(
        "upstream_usage_untrusted",
        request_id=rec.request_id,
        upstream=upstream,
        figures={r.figure: r.why for r in exact.refused},
    )


def rejected(
    app: AppView, out: ClientWriter, head: RequestHead | None, request_id: bytes,
    peer_host: str | None, err: RelayError,
) -> None:  # fmt: skip
    """A request refused before it was read whole (400/408/413/431), once answered: a row
    all the same. `out`: the client connection's writer (what the answer's body took)."""
    headers = head.headers if head is not None else []
    rec = Record(
        ts=time.time(),
        request_id=request_id.decode(),
        path=route_path(head.target) if head is not None else "",
        method=bounded(head.method.decode("latin-1"), 32) if head is not None else "",
        status=err.status,
        error_code=err.code,
        bytes_out=out.sent,
        outcome=Outcome.REJECTED,
        client_addr=peer_host,
        user_agent=user_agent(headers) if head is not None else None,
    )
    app.registry.rejected(err.code)
    if app.otel is not None:
        # Its span begins and ends here.
        app.otel.rejected(rec, headers)
    app.put_row(rec)
    app.log.record("access", rec.log_fields())
