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

Pure byte builders; `Shape` has the same methods `StreamFrames` uses for the llama shape.
"""

from __future__ import annotations

import random
import string

import msgspec

SHAPES = ("llama", "vllm", "openai")
OBF_MAX = 24
OPENAI_FINGERPRINT = "fp_f986a632b0"
_ALNUM = string.ascii_letters + string.digits
_jdump = msgspec.json.Encoder().encode


class Shape:
    """One chat stream's chunk bytes in vLLM's or OpenAI's shape."""

    __slots__ = ("head", "kind", "pads", "usage_null")

    def __init__(
        self,
        kind: str,
        rid: str,
        created: int,
        model: str,
        include_usage: bool,
        rng: random.Random | None = None,
    ) -> None:
        self.kind = kind
        rng = rng or random.Random()
        # 64 paddings drawn once, event i takes pads[i % 64]: a content-length body's size is
        # known before its events are sent, and a token costs no random draws
        self.pads = [
            b',"obfuscation":"%s"}\n\n'
            % "".join(rng.choices(_ALNUM, k=rng.randint(1, OBF_MAX))).encode()
            for _ in range(64)
        ]
        head = b'{"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s' % (
            rid.encode(),
            created,
            _jdump(model),
        )
        if kind == "openai":
            head += b',"service_tier":"default","system_fingerprint":"%s"' % (
                OPENAI_FINGERPRINT.encode()
            )
        self.head = head
        self.usage_null = b',"usage":null' if include_usage else b""

    def _end(self, j: int) -> bytes:
        """What closes the chunk of event j: OpenAI's padding, `}`."""
        return self.pads[j & 63] if self.kind == "openai" else b"}\n\n"

    def _choice(self, j: int, delta: bytes, finish: bytes = b"null", extra: bytes = b"") -> bytes:
        return (
            b"data: "
            + self.head
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
        refusal = b',"refusal":null' if self.kind == "openai" else b""
        return self._choice(63, b'{"role":"assistant","content":""' + refusal + b"}")

    def event(self, i: int, text: str) -> bytes:
        return self._choice(i, b'{"content":' + _jdump(text) + b"}")

    def final_events(
        self, finish: str, prompt_n: int, completion_n: int, include_usage: bool
    ) -> bytes:
        fin = _jdump(finish)
        if self.kind == "vllm":
            out = self._choice(62, b'{"content":""}', fin, b',"stop_reason":null')
        else:
            out = self._choice(62, b"{}", fin)
        if include_usage:
            use: dict[str, int | dict[str, int]] = {
                "prompt_tokens": prompt_n,
                "completion_tokens": completion_n,
                "total_tokens": prompt_n + completion_n,
            }
            if self.kind == "vllm":  # vLLM's key order
                use = {
                    "prompt_tokens": prompt_n,
                    "total_tokens": prompt_n + completion_n,
                    "completion_tokens": completion_n,
                }
            else:
                use["prompt_tokens_details"] = {"cached_tokens": 0, "audio_tokens": 0}
                use["completion_tokens_details"] = {
                    "reasoning_tokens": 0,
                    "audio_tokens": 0,
                    "accepted_prediction_tokens": 0,
                    "rejected_prediction_tokens": 0,
                }
            out += b"data: " + self.head + b',"choices":[],"usage":' + _jdump(use) + self._end(61)
        return out
