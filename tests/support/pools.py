"""A pool of simulators behind a relay (issue 32): conversations in each API's shape that grow
turn by turn, streams held open until the test lets them go, and where each request landed.

A `Conversation` is what an agent resends every turn: its first turn, then `follow` appends
the reply and a new message (chat, Anthropic Messages in Claude Code's style with the
`cache_control` markers moved to the newest message, OpenAI Responses) or appends to the string
prompt (legacy completions, native `/completion`). `Held` is a stream under way through the
relay, read in the background so that it never waits on the client, until the test closes it:
it holds its member's slot exactly as long as the test wants. `landed` names the member a
request reached, by the `X-Request-Id` the relay passes upstream, from the simulators' own
request logs.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json

from relay.config import UpstreamConfig
from relay.sim.server import Simulator
from tests.support import httpc

MODEL = "tiny"
SYSTEM = "You are a careful coding agent. Answer briefly."
TOOLS_MESSAGES = [
    {
        "name": "read_file",
        "description": "Read a file of the project.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]
TOOLS_CHAT = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
# An endless stream at a calm pace: held until the test closes it.
HOLD = {"chatty": True, "interval_ms": 40}
EPHEMERAL = {"type": "ephemeral"}

_ids = itertools.count(1)


def members(*urls: str, parallel: int = 2, queue: int = 8, **kw) -> list[UpstreamConfig]:
    """Upstreams m0, m1, ... each listing MODEL: one pool, in this order."""
    return [
        UpstreamConfig(name=f"m{i}", url=u, models=[MODEL], parallel=parallel, queue=queue, **kw)
        for i, u in enumerate(urls)
    ]


def text_block(text: str, marked: bool = False) -> dict:
    block: dict = {"type": "text", "text": text}
    if marked:
        block["cache_control"] = EPHEMERAL
    return block


PATHS = {
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
    "completions": "/v1/completions",
    "native": "/completion",
}


class Conversation:
    """One conversation of `api` (chat, messages, responses, completions, native), named
    `name`, of an agent whose system prompt is `system`: the body of its current turn, and the
    next turn's."""

    def __init__(self, api: str, name: str, system: str = SYSTEM) -> None:
        self.api = api
        self.name = name
        self.path = PATHS[api]
        self.turn = 1
        first = f"[{name}] Please look at the parser of module {name} and explain it."
        if api == "chat":
            self.doc: dict = {
                "tools": TOOLS_CHAT,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": first},
                ],
            }
        elif api == "messages":
            # Claude Code: the system prompt and the newest message carry cache_control.
            self.doc = {
                "max_tokens": 32000,
                "system": [text_block(system, marked=True)],
                "tools": TOOLS_MESSAGES,
                "messages": [{"role": "user", "content": [text_block(first, marked=True)]}],
            }
        elif api == "responses":
            self.doc = {
                "instructions": system,
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": first}],
                    }
                ],
            }
        else:
            # A prompt of several 256-byte blocks, this conversation's own from its start.
            filler = " ".join(f"{name}-line-{i}: def parse(x): return x" for i in range(20))
            self.doc = {"prompt": f"{first}\n{filler}\n"}

    def body(self, stream: bool = True, **knobs) -> dict:
        """This turn's request body, with the simulator's `knobs`."""
        body = {"model": MODEL, **copy.deepcopy(self.doc), "stream": stream}
        if knobs:
            body["sim"] = knobs
        return body

    def follow(self, reply: str = httpc.sim_text(8)) -> Conversation:
        """The next turn: the whole conversation, the reply it got and a new message."""
        self.turn += 1
        ask = f"[{self.name}] Now the lexer, part {self.turn}."
        doc = self.doc
        if self.api == "chat":
            doc["messages"] += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": ask},
            ]
        elif self.api == "messages":
            for message in doc["messages"]:
                for block in message["content"]:
                    block.pop("cache_control", None)
            doc["messages"] += [
                {"role": "assistant", "content": [text_block(reply)]},
                {"role": "user", "content": [text_block(ask, marked=True)]},
            ]
        elif self.api == "responses":
            doc["input"] += [
                {
                    "type": "message",
                    "id": f"msg_{next(_ids)}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": reply, "annotations": []}],
                },
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": ask}],
                },
            ]
        else:
            doc["prompt"] += f"{reply}\n{ask}\n"
        return self


class Held:
    """A stream under way through the relay at `port` (its head read), its body read in the
    background until the test closes it."""

    def __init__(self, port: int, path: str, body: dict, rid: str) -> None:
        self.port, self.path, self.body, self.rid = port, path, body, rid
        self.head: httpc.Response | None = None
        self.received = bytearray()
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None

    async def start(self, timeout: float = 30.0) -> Held:
        reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        headers = {"X-Request-Id": self.rid}
        self._writer.write(httpc.build_request("POST", self.path, self.body, headers))
        self.head = await asyncio.wait_for(httpc.read_head(reader), timeout)
        self._reading = asyncio.create_task(self._read(reader))
        return self

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while data := await reader.read(65536):
                self.received += data
                if self.received.endswith(b"\r\n0\r\n\r\n"):
                    # The terminating chunk: the response is whole (the connection stays).
                    return
        except ConnectionError:
            pass

    async def ended(self, timeout: float = 30.0) -> bytes:
        """The body's bytes (chunk framing included) once the response ended: its terminating
        chunk came, or the relay closed the connection."""
        assert self._reading is not None
        await asyncio.wait_for(asyncio.shield(self._reading), timeout)
        return bytes(self.received)

    @property
    def streaming(self) -> bool:
        """The response has not ended yet."""
        return self._reading is not None and not self._reading.done()

    @property
    def local_port(self) -> int:
        """The client's end of the connection (which relay process holds the other)."""
        assert self._writer is not None
        return self._writer.get_extra_info("sockname")[1]

    def close(self) -> None:
        """The client leaves: the relay ends the stream and frees its slot."""
        if self._writer is not None:
            self._writer.close()
        if self._reading is not None:
            self._reading.cancel()


async def hold(port: int, conv: Conversation, rid: str) -> Held:
    """`conv`'s current turn as a stream the test holds (an endless one, on a simulator)."""
    held = await Held(port, conv.path, conv.body(**HOLD), rid).start()
    assert held.head is not None and held.head.status == 200, held.head
    return held


def landed(sims: dict[str, Simulator], rid: str) -> list[str]:
    """The members whose simulator saw the request `rid`, in the order of `sims`."""
    key = rid.encode()
    return [
        name
        for name, sim in sims.items()
        if any(
            (b"x-request-id", key) in [(k.lower(), v) for k, v in r.headers] for r in sim.requests
        )
    ]


def sent_to(sim: Simulator, path: str) -> list[dict]:
    """The JSON bodies of the requests `sim` saw on `path`, in order."""
    return [
        r.json if r.json is not None else json.loads(r.body) for r in sim.requests if r.path == path
    ]
