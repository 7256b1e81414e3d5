"""The JSON of a finished completion, streamed or not: ids, timings, usage, native settings.

`timings` and `usage` ride in both the last streamed events and the non-streamed bodies (the
prompt's tokens reused from a slot's cache in ``timings.cache_n`` and
``usage.prompt_tokens_details.cached_tokens``, the others in ``timings.prompt_n``);
`native_final` is /completion's last object (its `generation_settings` in the real server's
key order); `nonstream_body` is a whole non-streamed chat, text or native completion.
"""

from __future__ import annotations

import random
import string
import time
from typing import TypedDict

from relay.sim.tinymodel import FINGERPRINT, gen_text
from relay.sim.wire import Finish, Json, Kind, Timings, jdump

_ALNUM = string.ascii_letters + string.digits


def new_id() -> str:
    return "chatcmpl-" + "".join(random.choices(_ALNUM, k=32))


class Usage(TypedDict):
    """The OpenAI routes' ``usage`` object, in llama-server's key order."""

    completion_tokens: int
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


def timings(
    prompt_n: int,
    predicted_n: int,
    predicted_ms: float,
    cache_n: int = 0,
    prompt_ms: float | None = None,
) -> Timings:
    """llama-server's ``timings``: `prompt_n` is the prompt tokens processed (`cache_n` more
    were reused), in `prompt_ms` (default 0.036 ms a token, the tiny model's pace)."""
    if prompt_ms is None:
        prompt_ms = prompt_n * 0.036
    prompt_ms = max(round(prompt_ms, 3), 0.001)
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


def usage(prompt_n: int, completion_n: int, cache_n: int = 0) -> Usage:
    """The OpenAI routes' usage: `prompt_n` the whole prompt, `cache_n` of it reused."""
    return {
        "completion_tokens": completion_n,
        "prompt_tokens": prompt_n,
        "total_tokens": prompt_n + completion_n,
        "prompt_tokens_details": {"cached_tokens": cache_n},
    }


# generation_settings of the native final event, in the real server's key order (split where
# per-request values go: stop, max_tokens, n_predict / stream).
_GEN_A: Json = {
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
_GEN_B: Json = {"n_keep": 0, "n_discard": 0, "ignore_eos": False}
_GEN_C: Json = {
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


def generation_settings(stop: list[str], limit: int, stream: bool) -> Json:
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
    finish: Finish,
    tm: Timings,
    stop_word: str | None = None,
    settings: Json | None = None,
    prompt: str = "",
    slot: int = 0,
) -> Json:
    """/completion's last object: `prompt_n` the whole prompt (``tokens_evaluated``), and what
    the slot (``id_slot``) then holds, ``tokens_cached``: the prompt and the tokens generated
    but the last."""
    return {
        "index": 0,
        "content": content,
        "tokens": [],
        "id_slot": slot,
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
        if finish == Finish.LENGTH
        else ("word" if stop_word is not None else "eos"),
        "stopping_word": stop_word or "",
        "tokens_cached": max(prompt_n + predicted_n - 1, 0),
        "timings": tm,
    }


def nonstream_body(
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
    cache_n: int = 0,
    slot: int = 0,
) -> bytes:
    """Non-streamed completion JSON (chat.completion / text_completion / native); `prompt_n`
    is the whole prompt, `cache_n` of it reused, `slot` the native answer's ``id_slot``."""
    created, rid = int(time.time()), new_id()
    if kind == Kind.CHAT:
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
                "usage": usage(prompt_n, predicted_n, cache_n),
                "id": rid,
                "timings": tm,
            }
        )
    if kind == Kind.TEXT:
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
                "usage": usage(prompt_n, predicted_n, cache_n),
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
            slot,
        )
    )
