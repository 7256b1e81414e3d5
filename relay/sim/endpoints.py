"""JSON bodies of the simulator's endpoints other than generation: the admin and helper routes.

/v1/models (and /models), /props, /slots, /metrics (Prometheus text), /tokenize, /detokenize
and the embeddings routes, in llama-server's key order, from the tiny model (tinymodel.py).
/slots shows a slot as llama-server does: id, context, speculation and whether it is
processing; once it took a task also that task's id, the tokens the slot holds, the prompt
tokens processed and reused, and its next token's state (all 0 / -1 but the task and the
tokens once the task ended; llama-server's ``params``, ``prompt`` and ``generated`` left out).
The token counts of /v1/messages/count_tokens and /v1/responses/input_tokens are those of the
prompt a generation would read. Pure builders; `misc_body` picks one by route name.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.sim import messages as M
from relay.sim import responses as R
from relay.sim.slots import SlotView
from relay.sim.tinymodel import FINGERPRINT, N_CTX, N_VOCAB, detokenize, embedding, tokenize
from relay.sim.wire import Json, Route, jdump


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


_PARAMS: Json = {
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


def _slot(v: SlotView) -> Json:
    out: Json = {"id": v.id, "n_ctx": N_CTX, "speculative": False, "is_processing": v.busy}
    if v.task >= 0:
        out["id_task"] = v.task
        out["n_prompt_tokens"] = v.n_tokens
        out["n_prompt_tokens_processed"] = v.processed
        out["n_prompt_tokens_cache"] = v.cached
        out["next_token"] = [
            {
                "has_next_token": v.busy,
                "has_new_line": False,
                "n_remain": v.remain,
                "n_decoded": v.decoded,
            }
        ]
    return out


def slots_body(slots: Sequence[SlotView]) -> bytes:
    return jdump([_slot(v) for v in slots])


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
    out: list[str] = []
    for name, typ, help_ in _METRICS:
        v = values.get(name, 0)
        out.append(
            f"# HELP llamacpp:{name} {help_}\n# TYPE llamacpp:{name} {typ}\nllamacpp:{name} {v:g}\n"
        )
    return "".join(out).encode()


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


def misc_body(
    route: Route, body: Json, model: str, created: int, slots: Sequence[SlotView]
) -> bytes:
    """JSON body of a non-generation endpoint (COUNT_TOKENS is /v1/messages/count_tokens,
    INPUT_TOKENS /v1/responses/input_tokens; a route not named here is the embeddings')."""
    if route == Route.HEALTH:
        return b'{"status":"ok"}'
    if route == Route.MODELS:
        return models_body(model, created)
    if route == Route.PROPS:
        return props_body(model, len(slots))
    if route == Route.SLOTS:
        return slots_body(slots)
    if route == Route.TOKENIZE:
        c = body.get("content")
        return jdump({"tokens": tokenize(c if isinstance(c, str) else "")})
    if route == Route.COUNT_TOKENS:
        return M.count_tokens_body(len(M.prompt_tokens(body)))
    if route == Route.INPUT_TOKENS:
        return R.input_tokens_body(len(R.prompt_tokens(body)))
    if route == Route.DETOKENIZE:
        t = body.get("tokens")
        return jdump({"content": detokenize(t if isinstance(t, list) else [])})
    inp = body.get("input", body.get("content", ""))
    texts = [x for x in inp if isinstance(x, str)] if isinstance(inp, list) else [str(inp)]
    return embeddings_body(model, texts)
