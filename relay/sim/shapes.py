"""Chat chunk shapes of servers other than llama-server, for the simulator's `shape` knob.

The relay's per-event speed must not depend on one server's byte layout, so the
simulator can speak, besides llama-server's own chat chunks (frames.py):

- ``vllm``: vLLM's OpenAI server, `{"id","object","created","model","choices":[{"index",
  "delta","logprobs":null,"finish_reason"}]}`, the first delta `{"role":"assistant",
  "content":""}`, and `"usage":null` on every chunk when `stream_options.include_usage` is
  set (then a last chunk with `"choices":[]` and the usage);
- ``openai``: OpenAI's hosted API, the same plus `service_tier` and `system_fingerprint` before
  `choices`, and the `obfuscation` field it adds after everything else in every chunk: random
  letters and digits of random length (1..`OBF_MAX`), padding that hides the text's size.

`ShapedChunks` builds one stream's chunks in another server's shape (wire.Shape names them,
llama-server's own included), with the methods `StreamFrames` uses for the llama shape. Pure
byte builders.
"""

from __future__ import annotations

import random
import string

import msgspec

from relay.sim.wire import Finish, Shape

# The shapes' names as plain strings, for the command line's choices and the knob's check.
SHAPES = tuple(s.value for s in Shape)
# The per-event code compares with this module-level name: on Python 3.11 a member's lookup on
# its enum class goes through the metaclass's attribute hook, several times a string compare.
_OPENAI = Shape.OPENAI
OBF_MAX = 24
OPENAI_FINGERPRINT = "fp_f986a632b0"
_ALNUM = string.ascii_letters + string.digits
_jdump = msgspec.json.Encoder().encode


class ShapedChunks:
    """One chat stream's chunk bytes in vLLM's or OpenAI's shape."""

    __slots__ = ("_ident", "pads", "shape", "usage_null")

    def __init__(
        self,
        shape: Shape,
        rid: str,
        created: int,
        model: str,
        include_usage: bool,
        rng: random.Random | None = None,
    ) -> None:
        self.shape = shape
        rng = rng or random.Random()
        # 64 paddings are drawn once, and event i takes pads[i % 64]: so a content-length
        # body's size is known before its events are sent, and a token costs no random draws.
        self.pads = [
            b',"obfuscation":"%s"}\n\n'
            % "".join(rng.choices(_ALNUM, k=rng.randint(1, OBF_MAX))).encode()
            for _ in range(64)
        ]
        # The keys every chunk opens with: its id, object, creation time and model (and
        # OpenAI's service tier and fingerprint).
        ident = b'{"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s' % (
            rid.encode(),
            created,
            _jdump(model),
        )
        if shape == Shape.OPENAI:
            ident += b',"service_tier":"default","system_fingerprint":"%s"' % (
                OPENAI_FINGERPRINT.encode()
            )
        self._ident = ident
        self.usage_null = b',"usage":null' if include_usage else b""

    def _end(self, j: int) -> bytes:
        """What closes the chunk of event j: OpenAI's padding, `}`."""
        return self.pads[j & 63] if self.shape == _OPENAI else b"}\n\n"

    def _choice(self, j: int, delta: bytes, finish: bytes = b"null", extra: bytes = b"") -> bytes:
        return (
            b"data: "
            + self._ident
            + b',"choices":[{"index":0,"delta":'
            + delta
            + b',"logprobs":null,"finish_reason":'
            + finish
            + extra
            + b"}]"
            + self.usage_null
            + self._end(j)
        )

    def role_event(self) -> bytes:
        refusal = b',"refusal":null' if self.shape == Shape.OPENAI else b""
        return self._choice(63, b'{"role":"assistant","content":""' + refusal + b"}")

    def event(self, i: int, text: str) -> bytes:
        return self._choice(i, b'{"content":' + _jdump(text) + b"}")

    def final_events(
        self,
        finish: Finish,
        prompt_n: int,
        completion_n: int,
        include_usage: bool,
        cache_n: int = 0,
    ) -> bytes:
        fin = _jdump(finish)
        if self.shape == Shape.VLLM:
            out = self._choice(62, b'{"content":""}', fin, b',"stop_reason":null')
        else:
            out = self._choice(62, b"{}", fin)
        if include_usage:
            use: dict[str, int | dict[str, int]] = {
                "prompt_tokens": prompt_n,
                "completion_tokens": completion_n,
                "total_tokens": prompt_n + completion_n,
            }
            if self.shape == Shape.VLLM:
                # vLLM's key order.
                use = {
                    "prompt_tokens": prompt_n,
                    "total_tokens": prompt_n + completion_n,
                    "completion_tokens": completion_n,
                }
            else:
                use["prompt_tokens_details"] = {"cached_tokens": cache_n, "audio_tokens": 0}
                use["completion_tokens_details"] = {
                    "reasoning_tokens": 0,
                    "audio_tokens": 0,
                    "accepted_prediction_tokens": 0,
                    "rejected_prediction_tokens": 0,
                }
            out += b"data: " + self._ident + b',"choices":[],"usage":' + _jdump(use) + self._end(61)
        return out
