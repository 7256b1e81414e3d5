"""A do-nothing OTLP/HTTP collector for the `relay_otel` bench target: answers every POST
200 with an empty body, counts requests and bytes, until killed. Run as
`python -m bench.otlp_sink --port N` (it prints `listening` once bound)."""

from __future__ import annotations

import argparse
import asyncio


class Sink:
    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                self.requests += 1
                self.bytes += length
                print(f"export {self.requests} {self.bytes}", flush=True)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
                    b"Content-Length: 0\r\n\r\n"
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


async def main(port: int) -> None:
    sink = Sink()
    server = await asyncio.start_server(sink.serve, "127.0.0.1", port)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    asyncio.run(main(p.parse_args().port))
