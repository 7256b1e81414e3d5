"""An OTLP/HTTP receiver on 127.0.0.1 for the OpenTelemetry tests: it decodes what it gets
with the official `opentelemetry-proto` messages, and can answer slowly, or never
(`answer=False`: a collector that accepts, reads every request whole and never says a word).

`spans()` flattens every span received; `metrics()` gives, per metric name, the data points
of the latest export that carried it (cumulative temporality: the latest holds the totals).
"""

from __future__ import annotations

import asyncio
import gzip

from tests.support.need import need_extra

need_extra("otel", "opentelemetry.proto")  # (skips the tests that use it, naming the extra)

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (  # noqa: E402
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def attrs(kvs) -> dict:
    """OTLP KeyValues -> {key: python value} (arrays as tuples)."""
    out = {}
    for kv in kvs:
        out[kv.key] = value(kv.value)
    return out


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class Receiver:
    def __init__(self, delay_s: float = 0.0, answer: bool = True) -> None:
        self.delay_s = delay_s  # before each answer: a slow collector
        self.answer = answer  # False: the requests are read, and held unanswered until `stop`
        self._held: set[asyncio.StreamWriter] = set()
        self.traces: list[ExportTraceServiceRequest] = []
        self.metric_exports: list[ExportMetricsServiceRequest] = []
        self.requests = 0
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Receiver:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self._held):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                self.requests += 1
                if not self.answer:
                    self._held.add(writer)
                    continue
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if path == "/v1/traces":
                    msg = ExportTraceServiceRequest()
                    msg.ParseFromString(body)
                    self.traces.append(msg)
                    answer = ExportTraceServiceResponse().SerializeToString()
                elif path == "/v1/metrics":
                    m = ExportMetricsServiceRequest()
                    m.ParseFromString(body)
                    self.metric_exports.append(m)
                    answer = ExportMetricsServiceResponse().SerializeToString()
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(answer) + answer
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    # ---- what came ------------------------------------------------------------------------
    def spans(self) -> list:
        return [
            span
            for req in self.traces
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def resources(self) -> list[dict]:
        return [attrs(rs.resource.attributes) for req in self.traces for rs in req.resource_spans]

    def metrics(self) -> dict[str, list]:
        """name -> the data points of the latest export that carried it."""
        latest: dict[str, list] = {}
        for req in self.metric_exports:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        latest[m.name] = [(m, p) for p in getattr(m, kind).data_points]
        return latest

    def points(self, name: str) -> list[tuple[dict, object]]:
        """(attributes, data point) of a metric's latest export."""
        return [(attrs(p.attributes), p) for _m, p in self.metrics().get(name, [])]


async def flushed(app) -> None:
    """Everything the relay has pending exported (in a thread: the receiver answers on this
    loop, and the SDK's flush blocks)."""
    await asyncio.to_thread(app.otel.flush, 5.0)
