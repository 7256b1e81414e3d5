"""Write a tiny, valid, *deterministic* llama-architecture GGUF model for e2e tests.

``write_tiny_model(path)`` writes (with llama.cpp's own ``gguf`` package) a ~0.5 MB f32
model: 64-dim embeddings, 2 layers, 4 heads, FFN 128, context 4096, a SentencePiece-style
(``llama``) vocabulary with ``<unk>``/``<s>``/``</s>``, all 256 byte-fallback tokens
``<0x00>``..``<0xFF>`` (any prompt tokenizes), the ChatML control tokens ``<|im_start|>`` /
``<|im_end|>``, a few word pieces (plus their prefixes, so the words also tokenize as whole
pieces) and a ChatML ``tokenizer.chat_template``.

How the output is made deterministic
------------------------------------
Attention-output and FFN-down weights are zero, so every block adds nothing to the residual
stream: the final hidden state is the embedding of the *current* token. Each token's
embedding is a one-hot vector on a "class" dimension (RMS-normed to 8.0), and the output
matrix gives the class's successor token a logit of +50 and every other token 0, so the
next token depends only on the current token and wins by e^(50/T) under any sampler
(temperature/top-k/top-p/min-p all agree). The transitions (``NEXT``) are:

* any token not listed below           -> " Hello"   (e.g. a completion prompt "Say hi")
* " Hello"/"Hello" -> " from" -> " a" -> " tiny" -> " llama" -> "." -> " Hello" -> ...
  i.e. the text "Hello from a tiny llama. Hello from a ..." cycles forever, so requests end
  with ``finish_reason: "length"`` (max_tokens / n_predict, or the slot context).
* "\\n" (byte token <0x0A>)            -> "Hello"    (no leading space). A ChatML generation
  prompt ends with "<|im_start|>assistant\\n", so a chat answer is
  "Hello from a tiny llama. Hello from ...".
* "?" -> " Fine" -> "," -> " thanks" -> "!" -> ``</s>`` (EOS)
  So a prompt whose LAST token is "?" (e.g. completion prompt "How are you?") yields exactly
  " Fine, thanks!" and ``finish_reason: "stop"`` (5 predicted tokens: 4 text + EOS).
  For chat, prefill the assistant turn with content ending in "?" (llama-server continues
  a trailing assistant message) to get the same EOS; or use a ``stop`` word such as ".".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy and gguf come with the 'e2e' extra; importing this module needs
    import numpy as np  # neither (the tests read its constants), writing a model needs both

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_FF = 128
N_CTX_TRAIN = 4096
MARGIN = 50.0  # logit of the chosen next token; every other logit is 0

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Word pieces of the vocabulary ("▁" is SentencePiece's space marker).
WORDS = [
    "▁Hello",
    "Hello",
    "▁from",
    "▁a",
    "▁tiny",
    "▁llama",
    "▁Fine",
    "▁thanks",
    "▁How",
    "▁are",
    "▁you",
    "▁Say",
    "▁hi",
    "▁there",
    "▁go",
    "▁user",
    "▁assistant",
    "▁system",
]
PUNCT = [".", ",", "!", "?"]

# current token -> next token; anything unlisted goes to DEFAULT_NEXT.
DEFAULT_NEXT = "▁Hello"
NEXT = {
    "▁Hello": "▁from",
    "Hello": "▁from",
    "▁from": "▁a",
    "▁a": "▁tiny",
    "▁tiny": "▁llama",
    "▁llama": ".",
    ".": "▁Hello",
    "<0x0A>": "Hello",
    "?": "▁Fine",
    "<0x3F>": "▁Fine",
    "▁Fine": ",",
    ",": "▁thanks",
    "▁thanks": "!",
    "!": "</s>",
}

# Texts the model produces (handy for assertions).
CYCLE_TEXT = " Hello from a tiny llama."
CHAT_TEXT_PREFIX = "Hello from a tiny llama. Hello from a tiny llama."
STOP_TRIGGER_PROMPT = "How are you?"
STOP_TEXT = " Fine, thanks!"


def build_vocab() -> tuple[list[str], list[float], list[int]]:
    """Return (tokens, scores, token types) of the SentencePiece-style vocabulary."""
    from gguf import TokenType

    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    scores: list[float] = [0.0, 0.0, 0.0]
    types: list[int] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(TokenType.BYTE)
    for special in ("<|im_start|>", "<|im_end|>"):
        tokens.append(special)
        scores.append(0.0)
        types.append(TokenType.CONTROL)
    # Every prefix (>= 2 chars) of each word, so SPM's pairwise merges can reach the word.
    # Longer pieces score higher, so merges prefer them.
    pieces: list[str] = []
    for word in WORDS:
        for n in range(2, len(word) + 1):
            if word[:n] not in pieces:
                pieces.append(word[:n])
    pieces += [p for p in PUNCT if p not in pieces]
    for piece in pieces:
        tokens.append(piece)
        scores.append(-100.0 + len(piece))
        types.append(TokenType.NORMAL)
    return tokens, scores, types


# The agents' variant (`write_tiny_model(..., ends_turn=True)`): "." ends the answer, so a chat
# turn is "Hello from a tiny llama." and a stop (an agent's turn ends, `end_turn`).
AGENT_NEXT = {**NEXT, ".": "</s>"}
AGENT_TEXT = "Hello from a tiny llama."


def build_weights(
    tokens: list[str], transitions: dict[str, str] = NEXT
) -> tuple[np.ndarray, np.ndarray]:
    """Return (token_embd [n_vocab, n_embd], output [n_vocab, n_embd]) implementing NEXT."""
    import numpy as np

    index = {t: i for i, t in enumerate(tokens)}
    targets = [DEFAULT_NEXT] + sorted(set(transitions.values()) - {DEFAULT_NEXT})
    assert len(targets) <= N_EMBD
    class_of_target = {t: k for k, t in enumerate(targets)}
    n_vocab = len(tokens)
    embd = np.zeros((n_vocab, N_EMBD), dtype=np.float32)
    embd[:, class_of_target[DEFAULT_NEXT]] = 1.0
    for src, dst in transitions.items():
        row = index[src]
        embd[row, :] = 0.0
        embd[row, class_of_target[dst]] = 1.0
    # RMSNorm turns a one-hot vector into sqrt(N_EMBD) * one-hot, so scale by that.
    scale = MARGIN / np.sqrt(N_EMBD)
    output = np.zeros((n_vocab, N_EMBD), dtype=np.float32)
    for target, k in class_of_target.items():
        output[index[target], k] = scale
    return embd, output


def write_tiny_model(
    path: str | Path, n_ctx_train: int = N_CTX_TRAIN, ends_turn: bool = False
) -> None:
    """Write the tiny deterministic model (see the module docstring) to ``path``; a larger
    ``n_ctx_train`` lets a server hold long prompts (an agent's system prompt and tools),
    `ends_turn` makes "." end the answer (`AGENT_NEXT`)."""
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType

    tokens, scores, types = build_vocab()
    embd, output = build_weights(tokens, AGENT_NEXT if ends_turn else NEXT)
    n_vocab = len(tokens)
    head_dim = N_EMBD // N_HEAD

    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-deterministic-llama")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(LlamaFileType.ALL_F32)

    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    ones = np.ones(N_EMBD, dtype=np.float32)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", embd)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(
                p + name + ".weight",
                (rng.standard_normal((N_EMBD, N_EMBD)) * 0.02).astype(np.float32),
            )
        w.add_tensor(p + "attn_output.weight", np.zeros((N_EMBD, N_EMBD), dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(
            p + "ffn_gate.weight", (rng.standard_normal((N_FF, N_EMBD)) * 0.02).astype(np.float32)
        )
        w.add_tensor(
            p + "ffn_up.weight", (rng.standard_normal((N_FF, N_EMBD)) * 0.02).astype(np.float32)
        )
        w.add_tensor(p + "ffn_down.weight", np.zeros((N_EMBD, N_FF), dtype=np.float32))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", output)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":  # pragma: no cover - manual use: python tiny_gguf.py out.gguf
    import sys

    write_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf")
