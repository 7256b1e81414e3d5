"""A fake event loop clock for code that arms loop timers (deadlines, the content hold, client
flow): `call_at` / `call_later` record timers, `call_soon` queues a callback, `run_until(t)`
fires the timers due by `t` in order, each followed by the callbacks it queued."""

from __future__ import annotations


class Timer:
    def __init__(self, when, fn, delay=None) -> None:
        self.when, self.fn, self.delay = when, fn, delay  # delay: what call_later was given
        self.cancelled = self.fired = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """time(), call_at(), call_later(), call_soon() and call_exception_handler() only. `timers`
    holds what was armed, in order; `armed()` (and `run_until`) drop the fired and cancelled
    ones. `ready` is the queue `call_soon` appends to; `run_ready_once()` is one pass of it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[Timer] = []
        self.ready: list[Timer] = []
        self.errors: list[dict] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when, fn) -> Timer:
        t = Timer(when, fn)
        self.timers.append(t)
        return t

    def call_later(self, delay, fn) -> Timer:
        t = Timer(self.now + delay, fn, delay)
        self.timers.append(t)
        return t

    def call_soon(self, fn) -> Timer:
        t = Timer(self.now, fn)
        self.ready.append(t)
        return t

    def run_ready_once(self) -> None:
        """One pass of the ready queue: what it queues waits for the next pass."""
        batch, self.ready = self.ready, []
        for t in batch:
            if not t.cancelled:
                t.fired = True
                t.fn()

    def run_ready(self) -> None:
        while self.ready:
            self.run_ready_once()

    def call_exception_handler(self, ctx) -> None:
        self.errors.append(ctx)

    def armed(self) -> list[Timer]:
        self.timers = [t for t in self.timers if not t.cancelled and not t.fired]
        return self.timers

    def run_until(self, end: float) -> None:
        """Fire the timers due by `end`, earliest first (the clock moves to each), each followed
        by what it queued with `call_soon`, then set the clock to `end`; it never goes back."""
        while True:
            self.run_ready()
            due = sorted((t for t in self.armed() if t.when <= end), key=lambda t: t.when)
            if not due:
                break
            t = due[0]
            self.now = max(self.now, t.when)
            t.fired = True
            t.fn()
        self.armed()
        self.now = max(self.now, end)
