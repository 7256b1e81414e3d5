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

from relay.store import admissions as durable
from relay.store.admissions import AdmissionId
from relay.store.schema import KEYS, record_values
from relay.store.sqlite_file import is_memory, open_readonly, take_lock
from relay.store.sqlite_writer import RowWriter, usage_sql


class Store(RowWriter):
    """Request rows and admission records in one SQLite file (or `:memory:`)."""

    # ---- event-loop side -------------------------------------------------------------
    def put(self, row: dict) -> None:
        self._put(tuple(map(row.get, KEYS)))

    def put_record(self, rec, admission_id=None) -> None:
        """A settled request's row read straight off its `Record` (no dict in between: one C
        call reads the columns; a bool column is stored as the integer it is)."""
        self._put(record_values(rec) + (admission_id,))

    def _put(self, values: tuple) -> None:
        if self._stopping:
            self._drop("store closed")
            return
        if len(self._queue) < self.queue_max and not self._overflow:
            self._queue.append(values)
        elif len(self._overflow) < self.overflow_max:
            self._overflow.append(values)
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
        rec,
        prompt_tokens: int,
        completion_tokens: int,
        timeout: float | None = None,
        res=None,
    ) -> None:
        """Commit a request's admission record (store.admissions) before going on. (`res`,
        the local reservation, matters to a shared budget only: store.postgres.)

        RuntimeError if it could not be written; with `timeout`, TimeoutError if it is not
        committed by then (the record is still written when the writer gets to it, and the
        request's row deletes it all the same)."""
        if self._stopping or self._thread is None or not self._thread.is_alive():
            raise RuntimeError("store is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fut.add_done_callback(_retrieved)  # its outcome may come after the caller left
        self._admits.append(
            (durable.values(admission_id, rec, prompt_tokens, completion_tokens), loop, fut)
        )
        self._wake.set()
        if timeout is None:
            await fut
        else:
            await asyncio.wait_for(asyncio.shield(fut), timeout)

    async def maintain(self, app) -> None:
        """Background upkeep while the relay runs: nothing for one SQLite file (a shared
        store renews its leases here)."""

    @property
    def pending(self) -> int:
        return self._accepted - self._settled

    def _drop(self, why: str) -> None:
        with self._settled_cv:  # rows_dropped is also counted by the writer thread
            self.rows_dropped += 1
        self._warn("drop", f"dropping request rows ({why}); {self.rows_dropped} dropped so far")

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
        if self._closed:
            return
        if self._thread is None and self._accepted:
            self.start()  # rows were accepted before start(): write them now
        self._closed = self._stopping = True
        if self._thread is None:
            return
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # stuck retrying a failing DB: give up the rest
            self._abandon.set()
            self._wake.set()
            self._thread.join()
        self._unlock()

    def _acquire(self) -> None:
        if not is_memory(self.path) and self._lock_fd is None:
            self._lock_fd = take_lock(self.path)  # before recover() touches the admissions

    def _unlock(self) -> None:
        """The writer is done with the database: another process may take it."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    # ---- reading ---------------------------------------------------------------------
    def query(self, sql: str, params=()) -> list[dict]:
        if not is_memory(self.path):
            conn = open_readonly(self.path)
            try:
                return conn.execute(sql, params).fetchall()
            finally:
                conn.close()
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("in-memory store: query needs the running writer")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._controls.append((sql, params, fut))
        self._wake.set()
        return fut.result(timeout=30.0)

    def usage_since(
        self, key_id: str | None, since_ts: float, served_only: bool = False
    ) -> tuple[int, int]:
        """(requests, tokens) of a key since a time; `served_only` counts only requests an
        upstream served (what a budget charges)."""
        row = self.query(usage_sql(served_only), (key_id, since_ts))[0]
        return int(row["n"]), int(row["tokens"])

    def usage_read(self, windows: list[tuple[str, float]]) -> concurrent.futures.Future:
        """The charged usage, (requests, tokens) of each (key, since), of the rows of
        exactly the requests settled until now: read by the writer thread once their rows are
        committed, before any later row is (store.sqlite_writer). The caller waits for the
        future where it likes (a reload: off the event loop); cancelled, it is not read."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping or self._thread is None or not self._thread.is_alive():
            fut.set_exception(RuntimeError("store is not running"))
            return fut
        self._reads.append((self._accepted, list(windows), fut))
        self._wake.set()
        return fut


def _retrieved(fut) -> None:
    """Mark an admission's outcome seen (its caller may have stopped waiting)."""
    if not fut.cancelled():
        fut.exception()
