"""How a request ended, decided once, at settlement, from the facts its dispatcher recorded.

The facts (relay.proxy.ledger): the last attempt's exchange, frozen when it ended
(`stream.summary.ExchangeSummary`); whether content reached the client (the hold opened);
the error the request was answered with, over HTTP or in-band; a cut (the client left, or
the drain ended the request); what the wait for the client to read a finished response
said; a bug. From them: the outcome (`errors.Outcome`, the access line's), the row's
`error_code` and `status`, whether an upstream served the request (its row names it and it
is charged), and whether it went well (`ok`).
"""

from __future__ import annotations

from typing import NamedTuple

from relay.errors import Outcome, RelayError
from relay.stream.summary import ExchangeSummary

# Endings of an exchange that, before any content reached the client, leave the request to
# the next candidate, or to an error the relay answers with.
FAILED_BEFORE_CONTENT = frozenset(
    {
        Outcome.UPSTREAM_DROPPED,
        Outcome.UPSTREAM_BAD_FRAMING,
        Outcome.STALL,
        Outcome.UPSTREAM_ERROR_EVENT,
        Outcome.SHUTDOWN,
    }
)
# Of those, the ones after which no upstream answered the client.
_NOT_SERVED = FAILED_BEFORE_CONTENT - {Outcome.UPSTREAM_ERROR_EVENT}
# A cut the relay made (its drain) or the client did (it left).
CUTS = frozenset({Outcome.CLIENT_CLOSED, Outcome.SHUTDOWN})


class Verdict(NamedTuple):
    outcome: Outcome
    # The row's error code (None: none) and status (None: no answer was given).
    code: str | None
    status: int | None
    # An upstream served the request: the row names it, its key is charged.
    served: bool
    ok: bool


def decide(
    summary: ExchangeSummary | None,
    content_out: bool,
    answered: RelayError | None,
    cut: Outcome | None = None,
    drained: Outcome | None = None,
    bug: bool = False,
) -> Verdict:
    """`summary`: the last attempt's exchange, if one ended; `content_out`: the hold opened;
    `answered`: the error the request was answered with; `cut`: CLIENT_CLOSED or SHUTDOWN;
    `drained`: CLIENT_CLOSED or CLIENT_WRITE_TIMEOUT when a finished response did not reach
    the client whole; `bug`: an internal error ended the request."""
    ending = summary.ending if summary is not None else None
    served = summary is not None and (content_out or (cut is None and ending not in _NOT_SERVED))
    status = answered.status if answered is not None else None
    if status is None and served and summary is not None:
        status = summary.status
    outcome, code = _outcome(summary, content_out, answered, cut, drained, bug)
    if code is None and status is not None and status >= 400:
        code = f"upstream_{status}"
    ok = outcome is Outcome.DONE and status is not None and status < 400
    return Verdict(outcome, code, status, served, ok)


def _outcome(
    summary: ExchangeSummary | None,
    content_out: bool,
    answered: RelayError | None,
    cut: Outcome | None,
    drained: Outcome | None,
    bug: bool,
) -> tuple[Outcome, str | None]:
    if bug:
        return Outcome.INTERNAL_ERROR, Outcome.INTERNAL_ERROR
    if cut is not None:
        return cut, cut
    ending = summary.ending if summary is not None else None
    if answered is not None:
        if ending in FAILED_BEFORE_CONTENT and not content_out:
            assert summary is not None and ending is not None
            if ending is Outcome.UPSTREAM_ERROR_EVENT:
                # The upstream's own error, passed on: the row says so.
                return ending, ending
            if ending is Outcome.SHUTDOWN and not summary.status:
                # The drain cut the wait for the upstream's head.
                return ending, ending
            return ending, answered.code
        return Outcome.ERROR, answered.code
    if summary is None or ending is None:
        # (Nothing was answered and no exchange ended: the decision has no facts.)
        return Outcome.INTERNAL_ERROR, Outcome.INTERNAL_ERROR
    outcome = ending
    if ending is Outcome.DONE and drained is not None:
        outcome = drained
    if outcome is Outcome.DONE and summary.error_only:
        # A 2xx stream that carried only an error event.
        return Outcome.UPSTREAM_ERROR_EVENT, Outcome.UPSTREAM_ERROR_EVENT
    if summary.stall is not None:
        return outcome, summary.stall.code
    return outcome, (None if outcome is Outcome.DONE else outcome)
