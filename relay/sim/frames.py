"""The streamed events of one generation: `StreamFrames`, built once per request.

Every event reproduces a real llama.cpp ``llama-server`` stream (see the captures in
tests/support/captures/llama-server/): compact JSON in llama.cpp's key order, SSE event text,
chunked framing.
Events are spliced from per-request prefix/suffix bytes so a token costs one small
concatenation (and the chunk bytes of the 6-token cycle are cached); chat chunks in another
server's shape come from shapes.py. Pure byte builders, no I/O.
"""

from __future__ import annotations

import random
import time

from relay.sim import messages as M
from relay.sim import responses as R
from relay.sim.completion import native_final, new_id, nonstream_body, usage
from relay.sim.shapes import ShapedChunks
from relay.sim.tinymodel import EOS_ID, FINGERPRINT, TOKEN_IDS, token_text
from relay.sim.wire import (
    DONE_EVENT,
    OCTET_CT,
    SSE_CT,
    TERMINATOR,
    Finish,
    Json,
    Kind,
    Shape,
    Timings,
    ToolCall,
    chunk,
    jdump,
)

# The per-event methods compare with these module-level names: on Python 3.11 a member's lookup
# on its enum class goes through the metaclass's attribute hook, several times a string compare.
_CHAT, _NATIVE, _OCTET = Kind.CHAT, Kind.NATIVE, Kind.OCTET


def octet_payload(i: int) -> bytes:
    return bytes(((i * 7 + j * 13) & 0xFF) for j in range(32))


class StreamFrames:
    """Per-request event builder, by the body's `Kind`: chat, text (/v1/completions), native
    or octet here; messages and responses from messages.py and responses.py (`api`).
    `prompt_n` is the whole prompt, `cache_n` of it reused from `slot` (native ``id_slot``)."""

    __slots__ = (
        "_cache",
        "_model_json",
        "_post",
        "_pre",
        "_repeats",
        "alt",
        "api",
        "cache_n",
        "created",
        "id",
        "include_usage",
        "kind",
        "model",
        "prompt_n",
        "slot",
    )

    def __init__(
        self,
        kind: Kind,
        model: str,
        prompt_n: int,
        include_usage: bool = False,
        created: int | None = None,
        rid: str | None = None,
        shape: Shape = Shape.LLAMA,
        rng: random.Random | None = None,
        text_n: int | None = None,
        tool: ToolCall | None = None,
        empty_timings: Timings | None = None,
        cache_n: int = 0,
        slot: int = 0,
    ) -> None:
        self.kind = kind
        self.model = model
        self.prompt_n, self.cache_n, self.slot = prompt_n, cache_n, slot
        self.include_usage = include_usage
        self.created = int(time.time()) if created is None else created
        self.id = rid or new_id()
        self._cache: dict[int, bytes] = {}
        self.api: M.MessagesFrames | R.ResponsesFrames | None = None
        if kind == Kind.MESSAGES:
            self.api = M.MessagesFrames(model, prompt_n, text_n, tool, cache_n=cache_n)
        elif kind == Kind.RESPONSES:
            self.api = R.ResponsesFrames(
                model, prompt_n, text_n, tool, empty_timings, cache_n=cache_n
            )
        m = self._model_json = jdump(model)
        if kind == Kind.CHAT:
            self._pre = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":'
            self._post = (
                b'}}],"created":%d,"id":"%s","model":%s,"system_fingerprint":"%s",'
                b'"object":"chat.completion.chunk"}\n\n'
                % (self.created, self.id.encode(), m, FINGERPRINT.encode())
            )
        elif kind == Kind.TEXT:
            self._pre = b'data: {"choices":[{"text":'
            self._post = (
                b',"index":0,"logprobs":null,"finish_reason":null}],"created":%d,"model":%s,'
                b'"system_fingerprint":"%s","object":"text_completion","id":"%s"}\n\n'
                % (self.created, m, FINGERPRINT.encode(), self.id.encode())
            )
        elif kind == Kind.NATIVE:
            self._pre = b'data: {"index":0,"content":'
            self._post = b',"stop":false,"id_slot":-1,"tokens_predicted":'
        else:
            self._pre = self._post = b""
        # Another server's chat chunks (shapes.py); None for llama-server's own.
        self.alt = (
            ShapedChunks(shape, self.id, self.created, model, include_usage, rng)
            if kind == Kind.CHAT and shape != Shape.LLAMA
            else None
        )
        # Whether a content event's chunk is the same every cycle of tokens, so framed once: a
        # native event counts its tokens, and OpenAI's padding differs from event to event.
        self._repeats = kind != Kind.NATIVE and (self.alt is None or shape != Shape.OPENAI)

    @property
    def content_type(self) -> bytes:
        return OCTET_CT if self.kind == Kind.OCTET else SSE_CT

    def role_event(self) -> bytes | None:
        if self.api is not None:
            return self.api.role_event()
        if self.kind != Kind.CHAT:
            return None
        if self.alt is not None:
            return self.alt.role_event()
        return (
            b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null'
            + self._post
        )

    def event(self, i: int) -> bytes:
        """Unframed bytes of content event i (an SSE event, or a binary blob for octet)."""
        kind = self.kind
        if self.api is not None:
            return self.api.event(i)
        if kind == _OCTET:
            return octet_payload(i)
        text = token_text(i, kind == _CHAT)
        if self.alt is not None:
            return self.alt.event(i, text)
        if kind == _NATIVE:
            return b'%s%s,"tokens":[%d]%s%d,"tokens_evaluated":%d}\n\n' % (
                self._pre,
                jdump(text),
                TOKEN_IDS[text],
                self._post,
                i + 1,
                self.prompt_n,
            )
        return self._pre + jdump(text) + self._post

    def chunk(self, i: int) -> bytes:
        """Chunk-framed content event i (cached per token-cycle position when possible)."""
        if self.api is not None:
            return self.api.chunk(i)
        if not self._repeats:
            return chunk(self.event(i))
        key = (
            -1 if (i == 0 and self.kind == _CHAT) else (i % 6 if self.kind != _OCTET else i & 0xFF)
        )
        c = self._cache.get(key)
        if c is None:
            c = self._cache[key] = chunk(self.event(i))
        return c

    def body_len(self, n: int) -> int:
        """Total length of content events 0..n-1 (unframed), without building them all."""
        if self.kind not in (Kind.CHAT, Kind.TEXT) or n <= 7 or self.alt is not None:
            return sum(len(self.event(i)) for i in range(n))
        base = [len(self.event(6 + k)) for k in range(6)]
        # Events 1..n-1 cycle through the residues 1, 2, 3, 4, 5, 0.
        full, rem = divmod(n - 1, 6)
        return len(self.event(0)) + full * sum(base) + sum(base[1 : rem + 1])

    def stop_token_event(
        self, n: int, predicted_n: int, stop_word: str | None, eos: bool, tm: Timings
    ) -> bytes:
        """Unframed event real llama-server sends for the stop token itself (EOS or the token
        holding a stop word, index ``n``) before the final event; b"" when there is none.

        /v1/completions: ``{"choices":[{"text":"",...,"finish_reason":null}],...}``, with
        ``timings`` after ``id`` for a stop word. Native: ``{"content":"","tokens":[id],
        "stop":false,...,"tokens_predicted":<predicted_n>,...}``, with ``timings`` for a stop word.
        """
        kind = self.kind
        if (stop_word is None and not eos) or kind not in (Kind.TEXT, Kind.NATIVE):
            return b""
        tail = b"}\n\n" if stop_word is None else b',"timings":' + jdump(tm) + b"}\n\n"
        if kind == Kind.TEXT:
            return self._pre + b'""' + self._post[:-3] + tail
        tid = EOS_ID if stop_word is None else TOKEN_IDS[token_text(n, False)]
        return b'%s"","tokens":[%d]%s%d,"tokens_evaluated":%d%s' % (
            self._pre,
            tid,
            self._post,
            predicted_n,
            self.prompt_n,
            tail,
        )

    def final_events(
        self,
        n: int,
        predicted_n: int,
        finish: Finish,
        tm: Timings,
        stop_word: str | None = None,
        settings: Json | None = None,
        prompt: str = "",
    ) -> bytes:
        """Unframed final event(s): finish event (+ usage event for chat with include_usage)."""
        kind = self.kind
        if self.api is not None:
            return self.api.final_events(n, predicted_n, finish, tm, stop_word)
        if self.alt is not None:
            return self.alt.final_events(
                finish, self.prompt_n, predicted_n, self.include_usage, self.cache_n
            )
        if kind == Kind.CHAT:
            fin: Json = {
                "choices": [{"finish_reason": finish, "index": 0, "delta": {}}],
                "created": self.created,
                "id": self.id,
                "model": self.model,
                "system_fingerprint": FINGERPRINT,
                "object": "chat.completion.chunk",
            }
            if not self.include_usage:
                fin["timings"] = tm
                return b"data: " + jdump(fin) + b"\n\n"
            use: Json = {
                "choices": [],
                "created": self.created,
                "id": self.id,
                "model": self.model,
                "system_fingerprint": FINGERPRINT,
                "object": "chat.completion.chunk",
                "usage": usage(self.prompt_n, predicted_n, self.cache_n),
                "timings": tm,
            }
            return b"data: " + jdump(fin) + b"\n\ndata: " + jdump(use) + b"\n\n"
        if kind == Kind.TEXT:
            fin = {
                "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": finish}],
                "created": self.created,
                "model": self.model,
                "system_fingerprint": FINGERPRINT,
                "object": "text_completion",
                "usage": usage(self.prompt_n, predicted_n, self.cache_n),
                "id": self.id,
                "timings": tm,
            }
            return b"data: " + jdump(fin) + b"\n\n"
        if kind == Kind.NATIVE:
            return (
                b"data: "
                + jdump(
                    native_final(
                        "",
                        self.model,
                        self.prompt_n,
                        predicted_n,
                        finish,
                        tm,
                        stop_word,
                        settings,
                        prompt,
                        self.slot,
                    )
                )
                + b"\n\n"
            )
        return b""

    @property
    def done_event(self) -> bytes:
        return DONE_EVENT if self.kind in (Kind.CHAT, Kind.TEXT) else b""

    def tail_chunks(self, final: bytes) -> bytes:
        """Final event(s) chunk, [DONE] chunk (if any) and the terminating chunk."""
        out = chunk(final) if final else b""
        if self.done_event:
            out += chunk(DONE_EVENT)
        return out + TERMINATOR


def any_nonstream_body(
    kind: Kind,
    model: str,
    prompt_n: int,
    n: int,
    predicted_n: int,
    finish: Finish,
    tm: Timings,
    stop_word: str | None = None,
    settings: Json | None = None,
    prompt: str = "",
    text_n: int | None = None,
    tool: ToolCall | None = None,
    cache_n: int = 0,
    slot: int = 0,
) -> bytes:
    """The non-streamed body of any generation route (completion.py's, or the APIs'):
    `prompt_n` the whole prompt, `cache_n` of it reused, on `slot`."""
    if kind == Kind.MESSAGES:
        return M.nonstream_body(
            model, prompt_n, n, predicted_n, finish, stop_word, text_n, tool, cache_n
        )
    if kind == Kind.RESPONSES:
        return R.nonstream_body(model, prompt_n, n, predicted_n, text_n, tool, cache_n)
    return nonstream_body(
        kind,
        model,
        prompt_n,
        n,
        predicted_n,
        finish,
        tm,
        stop_word,
        settings,
        prompt,
        cache_n,
        slot,
    )
