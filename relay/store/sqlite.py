"""Durable request rows in SQLite, written by one thread off the event loop.

`put` (event-loop thread) only snapshots the row into a tuple and appends it to a deque: it
never blocks and never raises. `admit` is the one awaited write: a keyed request's admission
record (`store.admissions`), committed before its upstream is contacted and deleted in the
transaction that writes its row. The writer thread and its queue are `store.sqlite_writer`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import TYPE_CHECKING, cast

from relay.observe.record import Record
from relay.policy.budget import Budgets, Reservation
from relay.store import admissions as durable
from relay.store.admissions import AdmissionId
from relay.store.schema import COLUMNS, DbRow, Params, record_values
from relay.store.sqlite_file import is_memory, open_readonly, take_lock
from relay.store.sqlite_writer import (
    Admit,
    Query,
    Queued,
    RowWriter,
    UsageRead,
    WarningKind,
    usage_sql,
)

if TYPE_CHECKING:
    from relay.store.interface import RowStore


class Store(RowWriter):
    """Request rows and admission records in one SQLite file (or `:memory:`)."""

    # ---- event-loop side -------------------------------------------------------------
    def put(self, row: dict[str, object]) -> None:
        """A row given as a dict of its columns and its `admission_id` (tests, tools)."""
        admission_id = cast("AdmissionId | None", row.get("admission_id"))
        self._put((tuple(map(row.get, COLUMNS)), admission_id))

    def put_record(self, rec: Record, admission_id: AdmissionId | None = None) -> None:
        """A settled request's row read straight off its `Record` (no dict in between: one C
        call reads the columns; a bool column is stored as the integer it is)."""
        self._put((record_values(rec), admission_id))

    def _put(self, queued: Queued) -> None:
        if self._stopping:
            self._drop("store closed")
            return
        if len(self._queue) < self.queue_max and not self._overflow:
            self._queue.append(queued)
        elif len(self._overflow) < self.overflow_max:
            self._overflow.append(queued)
        else:
            self._drop("queue and overflow full")
            return
        self._accepted += 1
        if len(self._queue) >= self.batch_max and not self._wake.is_set():
            self._wake.set()

    def next_admission_id(self) -> AdmissionId:
        """An id for `admit`: the caller keeps it before awaiting, so a cancelled caller's
        row still deletes the record, which is written all the same."""
        self._admission_ids += 1
        return self._admission_ids

    async def admit(
        self,
        admission_id: AdmissionId,
        rec: Record,
        prompt_tokens: int,
        completion_tokens: int,
        timeout: float | None = None,
        res: Reservation | None = None,
    ) -> None:
        """Commit a request's admission record (store.admissions) before going on. (`res`,
        the local reservation, matters to a shared budget only: store.postgres.)

        RuntimeError if it could not be written; with `timeout`, TimeoutError if it is not
        committed by then (the record is still written when the writer gets to it, and the
        request's row deletes it all the same)."""
        if self._stopping or self._thread is None or not self._thread.is_alive():
            raise RuntimeError("store is not running")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        # Its outcome may come after the caller left.
        fut.add_done_callback(_retrieved)
        values = durable.values(admission_id, rec, prompt_tokens, completion_tokens)
        self._admits.append(Admit(values, loop, fut))
        self._wake.set()
        if timeout is None:
            await fut
        else:
            await asyncio.wait_for(asyncio.shield(fut), timeout)

    async def maintain(self, budgets: Budgets) -> None:
        """Background upkeep while the relay runs: nothing for one SQLite file (a shared
        store renews its leases here)."""

    @property
    def pending(self) -> int:
        return self._accepted - self._settled

    @property
    def spilled(self) -> int | None:
        """None: one SQLite file has no spill file (its rows wait in the queue)."""
        return None

    def _drop(self, why: str) -> None:
        # rows_dropped is also counted by the writer thread.
        with self._settled_cv:
            self.rows_dropped += 1
        self._warn(
            WarningKind.DROP, f"dropping request rows ({why}); {self.rows_dropped} dropped so far"
        )

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._acquire()
        self._thread = threading.Thread(target=self._run, name="relay-store", daemon=False)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._closed = self._stopping = True
            self._unlock()
            raise self._start_error

    def flush(self, timeout: float = 5.0) -> None:
        target = self._accepted
        if self._settled >= target:
            return
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("store writer is not running")
        self._wake.set()
        with self._settled_cv:
            if not self._settled_cv.wait_for(lambda: self._settled >= target, timeout):
                raise TimeoutError(
                    f"store flush: {target - self._settled} rows not committed after {timeout}s"
                )

    def close(self, timeout: float = 10.0) -> None:
        """Write what was accepted and stop the writer. One stuck retrying a failing
        database past `timeout` gives up the rest."""
        if self._closed:
            return
        # Rows accepted before start() are written now.
        if self._thread is None and self._accepted:
            self.start()
        self._closed = self._stopping = True
        if self._thread is None:
            return
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abandon.set()
            self._wake.set()
            self._thread.join()
        self._unlock()

    def _acquire(self) -> None:
        """The file's lock, taken before recover() touches the admissions."""
        if not is_memory(self.path) and self._lock_fd is None:
            self._lock_fd = take_lock(self.path)

    def _unlock(self) -> None:
        """The writer is done with the database: another process may take it."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    # ---- reading ---------------------------------------------------------------------
    def query(self, sql: str, params: Params = ()) -> list[DbRow]:
        if not is_memory(self.path):
            conn = open_readonly(self.path)
            try:
                rows: list[DbRow] = conn.execute(sql, params).fetchall()
                return rows
            finally:
                conn.close()
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("in-memory store: query needs the running writer")
        answer: concurrent.futures.Future[list[DbRow]] = concurrent.futures.Future()
        self._controls.append(Query(sql, params, answer))
        self._wake.set()
        return answer.result(timeout=30.0)

    def usage_since(
        self, key_id: str | None, since_ts: float, served_only: bool = False
    ) -> tuple[int, int]:
        """(requests, tokens) of a key since a time; `served_only` counts only requests an
        upstream served (what a budget charges)."""
        row = self.query(usage_sql(served_only), (key_id, since_ts))[0]
        return int(row["n"]), int(row["tokens"])

    def usage_read(
        self, windows: list[tuple[str, float]]
    ) -> concurrent.futures.Future[list[tuple[int, int]]]:
        """The charged usage, (requests, tokens) of each (key, since), of the rows of
        exactly the requests settled until now: read by the writer thread once their rows are
        committed, before any later row is (store.sqlite_writer). The caller waits for the
        future where it likes (a reload: off the event loop); cancelled, it is not read."""
        answer: concurrent.futures.Future[list[tuple[int, int]]] = concurrent.futures.Future()
        if self._stopping or self._thread is None or not self._thread.is_alive():
            answer.set_exception(RuntimeError("store is not running"))
            return answer
        self._reads.append(UsageRead(self._accepted, list(windows), answer))
        self._wake.set()
        return answer


def _retrieved(fut: asyncio.Future[None]) -> None:
    """Mark an admission's outcome seen (its caller may have stopped waiting)."""
    if not fut.cancelled():
        fut.exception()


if TYPE_CHECKING:
    # Checked by mypy, free at run time: the SQLite store is a RowStore.
    _checked: type[RowStore] = Store
