"""What the relay uses of a store, whichever keeps the rows.

Three classes implement it: `store.sqlite.Store` (one relay, one SQLite file),
`store.postgres.PgStore` (several relays on one PostgreSQL) and a worker's stand-in
(`workers.remote`), which hands rows and admissions to its parent's store. The App holds one
and reaches it only through these members. `put` of a plain dict, `query` and `flush` are the
concrete stores' own, for tests and readers that know which store they hold.
"""

from __future__ import annotations

import concurrent.futures
from typing import Protocol

from relay.observe.record import Record
from relay.policy.budget import Budgets, Reservation
from relay.store.admissions import AdmissionId


class RowStore(Protocol):
    """Request rows, admission records and the usage a budget is rebuilt from."""

    # Days a row is kept; a reload sets it and the next prune uses it (0: kept for ever).
    retention_days: float

    @property
    def recovered(self) -> int:
        """Admissions a crash left, turned into charged rows at `start`."""
        ...

    @property
    def rows_written(self) -> int: ...

    @property
    def rows_dropped(self) -> int: ...

    @property
    def pending(self) -> int:
        """Rows accepted and not yet committed (or spilled, or given up)."""
        ...

    @property
    def spilled(self) -> int | None:
        """Rows waiting in the spill file for the database; None where the store never
        spills (SQLite)."""
        ...

    def start(self) -> None:
        """Take the database (its lock, crash recovery) and start the writer; raises if it
        cannot be used."""
        ...

    def next_admission_id(self) -> AdmissionId:
        """An id for `admit`, taken before awaiting it: a cancelled caller's row still
        replaces the record."""
        ...

    async def admit(
        self,
        admission_id: AdmissionId,
        rec: Record,
        prompt_tokens: int,
        completion_tokens: int,
        timeout: float | None = None,
        res: Reservation | None = None,
    ) -> None:
        """Make a keyed request's admission durable before its upstream is contacted.
        RuntimeError when it cannot be; TimeoutError after `timeout`; BudgetExceeded when a
        shared budget (`res`) is spent across the relays."""
        ...

    def put_record(self, rec: Record, admission_id: AdmissionId | None = None) -> None:
        """A settled request's row, replacing its admission record; never blocks."""
        ...

    def usage_since(
        self, key_id: str | None, since_ts: float, served_only: bool = False
    ) -> tuple[int, int]:
        """(requests, tokens) of a key's rows since a time; `served_only`: those a budget
        charges."""
        ...

    def usage_read(
        self, windows: list[tuple[str, float]]
    ) -> concurrent.futures.Future[list[tuple[int, int]]]:
        """The charged (requests, tokens) of each (key, since), of the rows of exactly the
        requests settled until now; the caller waits for it off the event loop."""
        ...

    async def maintain(self, budgets: Budgets) -> None:
        """Upkeep while the relay runs (a shared store renews its leases and re-seeds
        `budgets`, the local view); runs until cancelled."""
        ...

    async def aclose(self) -> None:
        """Commit (or spill) what was accepted, and let the database go."""
        ...
