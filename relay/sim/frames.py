"""Byte builders for the llama-server simulator (pure functions, no I/O).

Everything here reproduces the wire shape of a real llama.cpp ``llama-server``
(see the captures in the shared fixtures): header set and order, compact JSON
with llama.cpp's key order, SSE event text and chunked framing.  Streaming
events are spliced from per-request prefix/suffix bytes so a token costs one
small concatenation (and the chunk bytes of the 6-token cycle are cached).
"""

from __future__ import annotations

import random
import string
import time
from http import HTTPStatus

import msgspec

from relay.sim.shapes import Shape

_enc = msgspec.json.Encoder()
jdump = _enc.encode

FINGERPRINT = "b0-unknown"
CYCLE = (" Hello", " from", " a", " tiny", " llama", ".")
TOKEN_IDS = {
    "Hello": 300,
    " Hello": 364,
    " from": 368,
    " a": 369,
    " tiny": 372,
    " llama": 375,
    ".": 31,
}
ID_TO_PIECE = {v: k for k, v in TOKEN_IDS.items()}
EOS_ID = 2  # "</s>" of the tiny model: sent as its own (empty-content) native event
N_VOCAB = 388
N_CTX = 2048
_ALNUM = string.ascii_letters + string.digits

JSON_CT = b"application/json; charset=utf-8"
SSE_CT = b"text/event-stream"
OCTET_CT = b"application/octet-stream"
METRICS_CT = b"text/plain; version=0.0.4"
KEEP_ALIVE = b"Keep-Alive: timeout=5, max=100"
TERMINATOR = b"0\r\n\r\n"
DONE_EVENT = b"data: [DONE]\n\n"

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "unavailable_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
ERROR_MESSAGES = {
    400: "Invalid request",
    401: "Invalid API Key",
    403: "Forbidden",
    404: "File Not Found",
    429: "Too many requests, try again later",
    500: "Internal server error (simulated)",
    503: "Loading model",
}


def new_id() -> str:
    return "chatcmpl-" + "".join(random.choices(_ALNUM, k=32))


def token_text(i: int, chat: bool) -> str:
    """Text of generated token ``i``: "Hello", " from", " a", " tiny", " llama", ".", " Hello", ..."""
    if i == 0 and chat:
        return "Hello"
    return CYCLE[i % 6]


def gen_text(n: int, chat: bool) -> str:
    full = "".join(CYCLE) * (n // 6) + "".join(CYCLE[: n % 6])
    return full[1:] if chat and n > 0 else full


def stop_words(stop) -> list[str]:
    """The request's stop strings (``stop`` may be a string or a list)."""
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return []
    return [s for s in stop if isinstance(s, str) and s]


def stop_match(stop, n: int, chat: bool) -> tuple[int, str] | None:
    """(index, word) of the first token (< n) whose text contains a stop string, else None."""
    words = stop_words(stop)
    if not words:
        return None
    for i in range(min(n, 7)):
        t = token_text(i, chat)
        for w in words:
            if w in t:
                return i, w
    return None


def stop_index(stop, n: int, chat: bool) -> int | None:
    """Index of the first token (< n) whose text contains a stop string, else None."""
    m = stop_match(stop, n, chat)
    return None if m is None else m[0]


def reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


def head(
    status: int,
    ctype: bytes,
    *,
    length: int | None = None,
    sse: bool = False,
    close: bool = False,
    extra: tuple[bytes, ...] = (),
) -> bytes:
    """Response head in llama-server's header order (chunked when length is None)."""
    lines = [
        b"HTTP/1.1 %d %s" % (status, reason(status)),
        b"Server: llama.cpp",
        b"Access-Control-Allow-Origin: ",
        *extra,
    ]
    if sse:
        lines.append(b"X-Accel-Buffering: no")
    lines.append(b"Content-Type: " + ctype)
    lines.append(
        b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    )
    lines.append(b"Connection: close" if close else KEEP_ALIVE)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def error_obj(code: int, message: str | None = None, type_: str | None = None) -> dict:
    """llama-server error object, key order code, message, type (as for 400/5xx)."""
    return {
        "error": {
            "code": code,
            "message": message or ERROR_MESSAGES.get(code, "simulated error"),
            "type": type_
            or ERROR_TYPES.get(code, "server_error" if code >= 500 else "invalid_request_error"),
        }
    }


def error_body(code: int, message: str | None = None, type_: str | None = None) -> bytes:
    return jdump(error_obj(code, message, type_))


NOT_FOUND_BODY = b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}'
ERROR_EVENT = b'data: {"error":{"code":500,"message":"simulated","type":"server_error"}}\n\n'


def timings(prompt_n: int, predicted_n: int, predicted_ms: float, cache_n: int = 0) -> dict:
    prompt_ms = max(round(prompt_n * 0.036, 3), 0.001)
    predicted_ms = max(round(predicted_ms, 3), 0.001)
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / max(prompt_n, 1),
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / max(predicted_n, 1),
        "predicted_per_second": 1000.0 * predicted_n / predicted_ms,
    }


def usage(prompt_n: int, completion_n: int) -> dict:
    return {
        "completion_tokens": completion_n,
        "prompt_tokens": prompt_n,
        "total_tokens": prompt_n + completion_n,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def octet_payload(i: int) -> bytes:
    return bytes(((i * 7 + j * 13) & 0xFF) for j in range(32))


class StreamFrames:
    """Per-request event builder. kind: "chat" | "text" (v1/completions) | "native" | "octet"."""

    __slots__ = (
        "_cache",
        "_model_json",
        "_post",
        "_pre",
        "alt",
        "created",
        "id",
        "include_usage",
        "kind",
        "model",
        "prompt_n",
    )

    def __init__(
        self,
        kind: str,
        model: str,
        prompt_n: int,
        include_usage: bool = False,
        created: int | None = None,
        rid: str | None = None,
        shape: str = "llama",
        rng=None,
    ) -> None:
        self.kind = kind
        self.model = model
        self.prompt_n = prompt_n
        self.include_usage = include_usage
        self.created = int(time.time()) if created is None else created
        self.id = rid or new_id()
        self._cache: dict[int, bytes] = {}
        m = self._model_json = jdump(model)
        if kind == "chat":
            self._pre = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":'
            self._post = (
                b'}}],"created":%d,"id":"%s","model":%s,"system_fingerprint":"%s",'
                b'"object":"chat.completion.chunk"}\n\n'
                % (self.created, self.id.encode(), m, FINGERPRINT.encode())
            )
        elif kind == "text":
            self._pre = b'data: {"choices":[{"text":'
            self._post = (
                b',"index":0,"logprobs":null,"finish_reason":null}],"created":%d,"model":%s,'
                b'"system_fingerprint":"%s","object":"text_completion","id":"%s"}\n\n'
                % (self.created, m, FINGERPRINT.encode(), self.id.encode())
            )
        elif kind == "native":
            self._pre = b'data: {"index":0,"content":'
            self._post = b',"stop":false,"id_slot":-1,"tokens_predicted":'
        else:
            self._pre = self._post = b""
        # another server's chat chunks (relay/sim_shapes.py); None: llama-server's own
        self.alt = (
            Shape(shape, self.id, self.created, model, include_usage, rng)
            if kind == "chat" and shape != "llama"
            else None
        )

    @property
    def content_type(self) -> bytes:
        return OCTET_CT if self.kind == "octet" else SSE_CT

    def role_event(self) -> bytes | None:
        if self.kind != "chat":
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
        if kind == "octet":
            return octet_payload(i)
        text = token_text(i, kind == "chat")
        if self.alt is not None:
            return self.alt.event(i, text)
        if kind == "native":
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
        if self.kind == "native" or (self.alt is not None and self.alt.kind == "openai"):
            return chunk(self.event(i))  # (OpenAI's padding differs from event to event)
        key = (
            -1
            if (i == 0 and self.kind == "chat")
            else (i % 6 if self.kind != "octet" else i & 0xFF)
        )
        c = self._cache.get(key)
        if c is None:
            c = self._cache[key] = chunk(self.event(i))
        return c

    def body_len(self, n: int) -> int:
        """Total length of content events 0..n-1 (unframed), without building them all."""
        if self.kind not in ("chat", "text") or n <= 7 or self.alt is not None:
            return sum(len(self.event(i)) for i in range(n))
        base = [len(self.event(6 + k)) for k in range(6)]
        full, rem = divmod(n - 1, 6)  # events 1..n-1 cycle through residues 1,2,3,4,5,0
        return len(self.event(0)) + full * sum(base) + sum(base[1 : rem + 1])

    def stop_token_event(
        self, n: int, predicted_n: int, stop_word: str | None, eos: bool, tm: dict
    ) -> bytes:
        """Unframed event real llama-server sends for the stop token itself (EOS or the token
        holding a stop word, index ``n``) before the final event; b"" when there is none.

        /v1/completions: ``{"choices":[{"text":"",...,"finish_reason":null}],...}``, with
        ``timings`` after ``id`` for a stop word. Native: ``{"content":"","tokens":[id],
        "stop":false,...,"tokens_predicted":<predicted_n>,...}``, with ``timings`` for a stop word.
        """
        kind = self.kind
        if (stop_word is None and not eos) or kind not in ("text", "native"):
            return b""
        tail = b"}\n\n" if stop_word is None else b',"timings":' + jdump(tm) + b"}\n\n"
        if kind == "text":
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
        finish: str,
        tm: dict,
        stop_word: str | None = None,
        settings: dict | None = None,
        prompt: str = "",
    ) -> bytes:
        """Unframed final event(s): finish event (+ usage event for chat with include_usage)."""
        kind = self.kind
        if self.alt is not None:
            return self.alt.final_events(finish, self.prompt_n, predicted_n, self.include_usage)
        if kind == "chat":
            fin = {
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
            use = {
                "choices": [],
                "created": self.created,
                "id": self.id,
                "model": self.model,
                "system_fingerprint": FINGERPRINT,
                "object": "chat.completion.chunk",
                "usage": usage(self.prompt_n, predicted_n),
                "timings": tm,
            }
            return b"data: " + jdump(fin) + b"\n\ndata: " + jdump(use) + b"\n\n"
        if kind == "text":
            fin = {
                "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": finish}],
                "created": self.created,
                "model": self.model,
                "system_fingerprint": FINGERPRINT,
                "object": "text_completion",
                "usage": usage(self.prompt_n, predicted_n),
                "id": self.id,
                "timings": tm,
            }
            return b"data: " + jdump(fin) + b"\n\n"
        if kind == "native":
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
                    )
                )
                + b"\n\n"
            )
        return b""

    @property
    def done_event(self) -> bytes:
        return DONE_EVENT if self.kind in ("chat", "text") else b""

    def tail_chunks(self, final: bytes) -> bytes:
        """Final event(s) chunk, [DONE] chunk (if any) and the terminating chunk."""
        out = chunk(final) if final else b""
        if self.done_event:
            out += chunk(DONE_EVENT)
        return out + TERMINATOR


# generation_settings of the native final event, in the real server's key order (split where
# per-request values go: stop, max_tokens, n_predict / stream).
_GEN_A = {
    "seed": 4294967295,
    "temperature": 0.800000011920929,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_k": 40,
    "top_p": 0.949999988079071,
    "min_p": 0.05000000074505806,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.10000000149011612,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ["\n", ":", '"', "*"],
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.10000000149011612,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.8999999761581421,
}
_GEN_B = {"n_keep": 0, "n_discard": 0, "ignore_eos": False}
_GEN_C = {
    "logit_bias": [],
    "n_probs": 0,
    "min_keep": 0,
    "grammar": "",
    "grammar_lazy": False,
    "grammar_triggers": [],
    "preserved_tokens": [],
    "chat_format": "Content-only",
    "reasoning_format": "deepseek",
    "reasoning_in_content": False,
    "generation_prompt": "",
    "samplers": [
        "penalties",
        "dry",
        "top_n_sigma",
        "top_k",
        "typ_p",
        "top_p",
        "min_p",
        "xtc",
        "temperature",
    ],
    "speculative.types": "none",
    "timings_per_token": False,
    "post_sampling_probs": False,
    "backend_sampling": False,
    "lora": [],
}


def generation_settings(stop: list[str], limit: int, stream: bool) -> dict:
    return {
        **_GEN_A,
        "stop": stop,
        "max_tokens": limit,
        "n_predict": limit,
        **_GEN_B,
        "stream": stream,
        **_GEN_C,
    }


def native_final(
    content: str,
    model: str,
    prompt_n: int,
    predicted_n: int,
    finish: str,
    tm: dict,
    stop_word: str | None = None,
    settings: dict | None = None,
    prompt: str = "",
) -> dict:
    return {
        "index": 0,
        "content": content,
        "tokens": [],
        "id_slot": 0,
        "stop": True,
        "model": model,
        "tokens_predicted": predicted_n,
        "tokens_evaluated": prompt_n,
        "generation_settings": settings
        if settings is not None
        else generation_settings([], -1, False),
        "prompt": prompt,
        "has_new_line": False,
        "truncated": False,
        "stop_type": "limit"
        if finish == "length"
        else ("word" if stop_word is not None else "eos"),
        "stopping_word": stop_word or "",
        "tokens_cached": max(prompt_n + predicted_n - 1, 0),
        "timings": tm,
    }


def nonstream_body(
    kind: str,
    model: str,
    prompt_n: int,
    n: int,
    predicted_n: int,
    finish: str,
    tm: dict,
    stop_word: str | None = None,
    settings: dict | None = None,
    prompt: str = "",
) -> bytes:
    """Non-streamed completion JSON (chat.completion / text_completion / native)."""
    created, rid = int(time.time()), new_id()
    if kind == "chat":
        return jdump(
            {
                "choices": [
                    {
                        "finish_reason": finish,
                        "index": 0,
                        "message": {"role": "assistant", "content": gen_text(n, True)},
                    }
                ],
                "created": created,
                "model": model,
                "system_fingerprint": FINGERPRINT,
                "object": "chat.completion",
                "usage": usage(prompt_n, predicted_n),
                "id": rid,
                "timings": tm,
            }
        )
    if kind == "text":
        return jdump(
            {
                "choices": [
                    {
                        "text": gen_text(n, False),
                        "index": 0,
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                ],
                "created": created,
                "model": model,
                "system_fingerprint": FINGERPRINT,
                "object": "text_completion",
                "usage": usage(prompt_n, predicted_n),
                "id": rid,
                "timings": tm,
            }
        )
    return jdump(
        native_final(
            gen_text(n, False),
            model,
            prompt_n,
            predicted_n,
            finish,
            tm,
            stop_word,
            settings,
            prompt,
        )
    )


# ----------------------------------------------------------------------------- misc endpoints


def models_body(model: str, created: int) -> bytes:
    return jdump(
        {
            "models": [
                {
                    "name": model,
                    "model": model,
                    "modified_at": "",
                    "size": "",
                    "digest": "",
                    "type": "model",
                    "description": "",
                    "tags": [""],
                    "capabilities": ["completion"],
                    "parameters": "",
                    "details": {
                        "parent_model": "",
                        "format": "gguf",
                        "family": "",
                        "families": [""],
                        "parameter_size": "",
                        "quantization_level": "",
                    },
                }
            ],
            "object": "list",
            "data": [
                {
                    "id": model,
                    "aliases": [model],
                    "tags": [],
                    "object": "model",
                    "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                    "created": created,
                    "owned_by": "llamacpp",
                    "meta": {
                        "vocab_type": 1,
                        "n_vocab": N_VOCAB,
                        "n_ctx": N_CTX,
                        "n_ctx_train": 4096,
                        "n_embd": 64,
                        "n_params": 131904,
                        "size": 527616,
                        "ftype": "all F32",
                    },
                }
            ],
        }
    )


_PARAMS = {
    "seed": 4294967295,
    "temperature": 0.800000011920929,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_k": 40,
    "top_p": 0.949999988079071,
    "min_p": 0.05000000074505806,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.10000000149011612,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.10000000149011612,
    "max_tokens": -1,
    "n_predict": -1,
    "n_keep": 0,
    "n_discard": 0,
    "ignore_eos": False,
    "stream": False,
    "n_probs": 0,
    "min_keep": 0,
    "chat_format": "Content-only",
    "reasoning_format": "none",
    "samplers": [
        "penalties",
        "dry",
        "top_n_sigma",
        "top_k",
        "typ_p",
        "top_p",
        "min_p",
        "xtc",
        "temperature",
    ],
    "timings_per_token": False,
    "post_sampling_probs": False,
    "lora": [],
}
_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def props_body(model: str, slots: int) -> bytes:
    return jdump(
        {
            "default_generation_settings": {"params": _PARAMS, "n_ctx": N_CTX},
            "total_slots": slots,
            "model_alias": model,
            "model_ftype": "all F32",
            "model_path": model,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": True,
            "endpoint_props": False,
            "endpoint_metrics": True,
            "chat_template": _TEMPLATE,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "build_info": FINGERPRINT,
            "is_sleeping": False,
        }
    )


def slots_body(slots: int, busy: int) -> bytes:
    return jdump(
        [
            {"id": i, "n_ctx": N_CTX, "speculative": False, "is_processing": i < busy}
            for i in range(slots)
        ]
    )


_METRICS = (
    (
        "prompt_tokens_total",
        "counter",
        "Number of prompt tokens processed, excluding cached tokens",
    ),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "counter", "Total time spent processing prompts"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens"),
    (
        "n_decode_total",
        "counter",
        "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
    ),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated"),
    (
        "spec_decode_num_accepted_tokens_total",
        "counter",
        "Speculative: Total draft tokens accepted by the target model",
    ),
    (
        "spec_decode_num_drafts_total",
        "counter",
        "Speculative: Total speculative decoding verification steps",
    ),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s"),
    ("requests_processing", "gauge", "Number of requests processing"),
    ("requests_deferred", "gauge", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call"),
)


def metrics_body(values: dict[str, float]) -> bytes:
    out = []
    for name, typ, help_ in _METRICS:
        v = values.get(name, 0)
        out.append(
            f"# HELP llamacpp:{name} {help_}\n# TYPE llamacpp:{name} {typ}\nllamacpp:{name} {v:g}\n"
        )
    return "".join(out).encode()


def tokenize(text: str) -> list[int]:
    """Deterministic fake tokenization: one token per 4 chars (at least one for non-empty text)."""
    if not text:
        return []
    n = max(1, len(text) // 4)
    data = text.encode()
    step = max(1, len(data) // n)
    return [sum(data[k * step : (k + 1) * step]) % N_VOCAB for k in range(n)]


def detokenize(ids: list) -> str:
    return "".join(ID_TO_PIECE.get(t, "") if isinstance(t, int) else "" for t in ids)


def embedding(text: str, dim: int = 8) -> list[float]:
    seed = sum(text.encode()) + len(text)
    return [((seed * (j + 3) * 2654435761) % 2000) / 1000.0 - 1.0 for j in range(dim)]


def embeddings_body(model: str, inputs: list[str]) -> bytes:
    n = sum(max(1, len(t) // 4) for t in inputs)
    return jdump(
        {
            "model": model,
            "object": "list",
            "usage": {"prompt_tokens": n, "total_tokens": n},
            "data": [
                {"embedding": embedding(t), "index": i, "object": "embedding"}
                for i, t in enumerate(inputs)
            ],
        }
    )


def misc_body(route: str, data: dict, model: str, created: int, slots: int, busy: int) -> bytes:
    """JSON body of a non-generation endpoint."""
    if route == "health":
        return b'{"status":"ok"}'
    if route == "models":
        return models_body(model, created)
    if route == "props":
        return props_body(model, slots)
    if route == "slots":
        return slots_body(slots, busy)
    if route == "tokenize":
        c = data.get("content")
        return jdump({"tokens": tokenize(c if isinstance(c, str) else "")})
    if route == "detokenize":
        t = data.get("tokens")
        return jdump({"content": detokenize(t if isinstance(t, list) else [])})
    inp = data.get("input", data.get("content", ""))
    inp = [x for x in inp if isinstance(x, str)] if isinstance(inp, list) else [str(inp)]
    return embeddings_body(model, inp)
