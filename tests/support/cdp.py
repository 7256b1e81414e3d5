"""A headless Chromium driven over the DevTools protocol, stdlib only (tests of the page).

Chromium is started with `--remote-debugging-port=0` and says on stderr where its DevTools
websocket listens; `Browser.page()` opens a tab and connects to it. The websocket is the
minimal RFC 6455 client the protocol needs: one connection, text frames (masked, as a client
must), fragments joined, pings answered. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import struct
import urllib.parse

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
)


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class WebSocket:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, url: str, timeout: float = 10.0) -> WebSocket:
        u = urllib.parse.urlsplit(url)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(u.hostname, u.port), timeout
        )
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(f"websocket upgrade refused: {head[:80]!r}")
        return cls(reader, writer)

    def send(self, text: str) -> None:
        data = text.encode()
        n = len(data)
        head = bytes([0x81])  # FIN, text
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack("!Q", n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        self.writer.write(head + mask + masked)

    async def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack("!H", await self.reader.readexactly(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", await self.reader.readexactly(8))[0]
            mask = await self.reader.readexactly(4) if b1 & 0x80 else None
            data = await self.reader.readexactly(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            op = b0 & 0x0F
            if op == 0x8:
                raise ConnectionError("websocket closed")
            if op == 0x9:  # ping -> pong
                self.writer.write(bytes([0x8A, 0x80 | len(data)]) + b"\0\0\0\0" + data)
                continue
            if op in (0x1, 0x2, 0x0):
                parts.append(data)
                if b0 & 0x80:
                    return b"".join(parts).decode()

    def close(self) -> None:
        self.writer.close()


class Page:
    """One tab: commands answered by id, events kept (console errors, exceptions, loads)."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.ids = 0
        self.waiting: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self.loaded = asyncio.Event()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                msg = json.loads(await self.ws.recv())
                if "id" in msg:
                    fut = self.waiting.pop(msg["id"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                else:
                    self.events.append(msg)
                    if msg.get("method") == "Page.loadEventFired":
                        self.loaded.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("DevTools connection closed"))

    async def send(self, method: str, timeout: float = 10.0, **params) -> dict:
        self.ids += 1
        fut = asyncio.get_running_loop().create_future()
        self.waiting[self.ids] = fut
        self.ws.send(json.dumps({"id": self.ids, "method": method, "params": params}))
        msg = await asyncio.wait_for(fut, timeout)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        return msg.get("result", {})

    async def navigate(self, url: str, timeout: float = 10.0) -> None:
        self.loaded.clear()
        await self.send("Page.navigate", url=url)
        await asyncio.wait_for(self.loaded.wait(), timeout)

    async def eval(self, expression: str, timeout: float = 10.0):
        """The value of a JS expression (a promise is awaited)."""
        res = await self.send(
            "Runtime.evaluate",
            timeout=timeout,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
        )
        if "exceptionDetails" in res:
            raise RuntimeError(f"JS error: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def wait_for(self, condition: str, timeout: float = 2.0):
        """Resolve when a JS expression is truthy (checked on every animation frame, bounded
        inside the page); its value, or an error naming the condition."""
        ms = int(timeout * 1000)
        js = (
            f"new Promise((ok, fail) => {{ const end = performance.now() + {ms};"
            f" const check = () => {{ let v; try {{ v = ({condition}); }} catch (e) {{ v = null; }}"
            f" if (v) ok(v); else if (performance.now() > end) fail(new Error('timeout'));"
            f" else requestAnimationFrame(check); }}; check(); }})"
        )
        try:
            return await self.eval(js, timeout=timeout + 5)
        except RuntimeError as exc:
            raise AssertionError(f"not within {timeout}s: {condition}") from exc

    async def viewport(self, width: int, height: int) -> None:
        """Lay the page out as in a window of `width` x `height` CSS pixels (one device pixel
        each), as a resized window does: the page sees its resize."""
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    async def mouse_move(self, x: float, y: float) -> None:
        """The mouse moved to (`x`, `y`), CSS pixels in the viewport."""
        await self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    async def screenshot(self, path: str) -> None:
        res = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(res["data"]))

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries seen so far."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(json.dumps(p["exceptionDetails"])[:300])
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(json.dumps(p.get("args"))[:300])
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"{p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    async def close(self) -> None:
        self.reader.cancel()
        self.ws.close()


class Browser:
    def __init__(self, proc, port: int) -> None:
        self.proc, self.port = proc, port

    @classmethod
    async def start(
        cls, exe: str, profile_dir: str, timeout: float = 30.0, flags: tuple[str, ...] = ()
    ) -> Browser:
        """`flags`: more command-line switches (`--host-resolver-rules=...`)."""
        proc = await asyncio.create_subprocess_exec(
            exe,
            *CHROMIUM_FLAGS,
            *flags,
            f"--user-data-dir={profile_dir}",
            "--remote-debugging-port=0",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            port = await asyncio.wait_for(cls._devtools_port(proc), timeout)
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        return cls(proc, port)

    @staticmethod
    async def _devtools_port(proc) -> int:
        while True:
            line = await proc.stderr.readline()
            if not line:
                raise RuntimeError("chromium exited before listening for DevTools")
            m = re.search(rb"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                asyncio.get_running_loop().create_task(_drain(proc.stderr))
                return int(m.group(1))

    async def _http_json(self, method: str, path: str):
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(
                f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            m = re.search(rb"(?i)content-length:\s*(\d+)", head)
            body = await asyncio.wait_for(reader.readexactly(int(m.group(1))), 10)
        finally:
            writer.close()
        return json.loads(body)

    async def page(self) -> Page:
        target = await self._http_json("PUT", "/json/new?about:blank")
        page = Page(await WebSocket.connect(target["webSocketDebuggerUrl"]))
        for domain in ("Page.enable", "Runtime.enable", "Log.enable"):
            await page.send(domain)
        return page

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _drain(stream) -> None:
    while await stream.readline():
        pass
