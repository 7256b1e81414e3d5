"""What the proxy layer reads of the relay process (relay.app.App): a Protocol, so that the
layer below the App is typed against it without importing it.

The App is the one implementation (a worker's App too, whose slots, budgets and store stand
in for its parent's: relay.workers); tests may give a smaller one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol

from relay.config import Config
from relay.http.fields import Headers
from relay.observe.log import Log
from relay.observe.metrics import Registry, UpstreamMetrics
from relay.observe.record import Record
from relay.observe.ui_state import Recent, Trend, Trended
from relay.policy.budget import Budgets
from relay.policy.cors import Cors
from relay.policy.keys import Auth
from relay.policy.routing import Router
from relay.store.admissions import AdmissionId
from relay.store.interface import RowStore
from relay.stream.stall import StallPolicy

if TYPE_CHECKING:
    from relay.observe.otel import Telemetry
    from relay.proxy.body_memory import BodyBytes
    from relay.proxy.deadlines import Deadlines
    from relay.proxy.slots import Balancer
    from relay.proxy.upstreams import Upstream


class ViewAnswer(NamedTuple):
    """One of the relay's own views as answered: status, body, content type, headers."""

    status: int
    body: bytes
    content_type: bytes
    headers: Headers


# A worker process answers the relay's own views from its parent (relay.workers): the path
# and the target (its query kept) in, the answer out.
RemoteView = Callable[[str, bytes], Awaitable[ViewAnswer]]


class AppView(Protocol):
    @property
    def config(self) -> Config: ...
    @property
    def log(self) -> Log: ...
    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    @property
    def deadlines(self) -> Deadlines: ...
    @property
    def policy(self) -> StallPolicy: ...
    @property
    def upstreams(self) -> Mapping[str, Upstream]: ...
    @property
    def router(self) -> Router: ...
    @property
    def balancer(self) -> Balancer: ...
    @property
    def auth(self) -> Auth: ...
    @property
    def cors(self) -> Cors: ...
    @property
    def budgets(self) -> Budgets: ...
    @property
    def registry(self) -> Registry: ...
    @property
    def store(self) -> RowStore: ...
    @property
    def otel(self) -> Telemetry | None: ...
    @property
    def bodies(self) -> BodyBytes: ...
    @property
    def draining(self) -> bool: ...
    @property
    def remote_view(self) -> RemoteView | None: ...
    @property
    def ui_recent(self) -> Recent: ...
    @property
    def ui_trend(self) -> Trend: ...

    def gauged(self) -> list[UpstreamMetrics]:
        """The upstreams' metrics with their live gauges refreshed."""
        ...

    def put_row(
        self, rec: Record, admission: AdmissionId | None = None, trend: Trended = Trended.NONE
    ) -> None:
        """A settled request's row."""
        ...

    def track(self, task: asyncio.Task[None]) -> None:
        """A request's task, counted by the drain."""
        ...
