"""How a request ended, decided once, at settlement, from the facts its dispatcher recorded;
and what follows an exchange that ended while nothing but comments reached the client.

`after_hold` is the dispatcher's rule the moment such an exchange ends: the next candidate's
turn, or the answer the request gets. `decide` is settlement's. Both read the same facts of
an exchange's ending, kept here once (`FAILED_BEFORE_CONTENT`).

The facts (relay.proxy.ledger): the last attempt's exchange, frozen when it ended
(`stream.summary.ExchangeSummary`); whether content reached the client (the hold opened);
the error the request was answered with, over HTTP or in-band; a cut (the client left, or
the drain ended the request); what the wait for the client to read a finished response
said; a bug. From them: the outcome (`errors.Outcome`, the access line's), the row's
`error_code` and `status`, whether an upstream served the request (its row names it and it
is charged), and whether it went well (`ok`).
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Literal

import msgspec

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
DONE = Outcome.DONE
# A cut the client made (it left) or the relay did (its drain ended the request); a finished
# response that did not reach the client whole (it left, or took too long to read it).
Cut = Literal[Outcome.CLIENT_CLOSED, Outcome.SHUTDOWN]
Drained = Literal[Outcome.CLIENT_CLOSED, Outcome.CLIENT_WRITE_TIMEOUT]


class Next(Enum):
    """What follows an exchange that ended while nothing but comments reached the client."""

    # It answered the client after all (its body went out whole, or the client left).
    SERVED = auto()
    # The next candidate serves the request.
    RETRY = auto()
    # The request is answered 502 `upstream_unavailable`.
    UNAVAILABLE = auto()
    # The request is answered with the upstream's own error event, passed on.
    UPSTREAM_ERROR = auto()
    # A response that cannot continue the event stream the relay committed (heartbeats):
    # answered in-band with the upstream's status.
    CANNOT_CONTINUE = auto()


def after_hold(ending: Outcome, committed: bool, more: bool) -> Next:
    """`ending`: how the exchange ended; `committed`: the relay's head and heartbeats went
    out; `more`: another candidate is left (the drain's cut is never retried)."""
    if ending in FAILED_BEFORE_CONTENT:
        if more and ending is not Outcome.SHUTDOWN:
            return Next.RETRY
        if ending is Outcome.UPSTREAM_ERROR_EVENT:
            return Next.UPSTREAM_ERROR
        return Next.UNAVAILABLE
    if committed and ending is DONE:
        return Next.CANNOT_CONTINUE
    return Next.SERVED


class Verdict(msgspec.Struct, frozen=True, gc=False, array_like=True):
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
    cut: Cut | None = None,
    drained: Drained | None = None,
    bug: bool = False,
) -> Verdict:
    """`summary`: the last attempt's exchange, if one ended; `content_out`: the hold opened;
    `answered`: the error the request was answered with; `cut`: CLIENT_CLOSED or SHUTDOWN;
    `drained`: CLIENT_CLOSED or CLIENT_WRITE_TIMEOUT when a finished response did not reach
    the client whole; `bug`: an internal error ended the request."""
    if (
        summary is not None
        and summary.ending is DONE
        and answered is None
        and cut is None
        and drained is None
        and not bug
        and not summary.error_only
    ):
        # The usual request: served, its exchange ended on its own, the client read it all.
        served = summary.status
        code = f"upstream_{served}" if served >= 400 else None
        return Verdict(DONE, code, served, True, served < 400)
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
    cut: Cut | None,
    drained: Drained | None,
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
