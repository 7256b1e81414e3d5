"""The tiny model the simulator pretends to serve: its vocabulary, its text, what it computes.

It writes " Hello from a tiny llama." over and over (chat starts at "Hello"), one token a
word; stop words are matched against that text; a tool call's arguments stream in runs of word
and other characters. Its tokenizer, detokenizer and embeddings are deterministic stand-ins
with the real server's output types. Pure functions, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The llama.cpp build it reports (system_fingerprint, build_info).
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
# "</s>" of the tiny model: sent as its own (empty-content) native event.
EOS_ID = 2
N_VOCAB = 388
N_CTX = 2048
# A tool call's arguments (the captures' call).
DEFAULT_TOOL_ARGS = '{"city": "Paris"}'
_PIECES = re.compile(r"\w+|\W+")


def token_text(i: int, chat: bool) -> str:
    """Text of generated token ``i``: "Hello", " from", " a", " tiny", " llama", ".", " Hello", ..."""
    if i == 0 and chat:
        return "Hello"
    return CYCLE[i % 6]


def gen_text(n: int, chat: bool) -> str:
    full = "".join(CYCLE) * (n // 6) + "".join(CYCLE[: n % 6])
    return full[1:] if chat and n > 0 else full


def arg_pieces(arguments: str) -> list[str]:
    """A tool call's arguments as the model would stream them: runs of word and other
    characters (``{"``, ``city``, ``": "``, ``Paris``, ``"}``); at least one piece."""
    return _PIECES.findall(arguments) or [arguments]


@dataclass(frozen=True, slots=True)
class StopMatch:
    """The generated token whose text holds a stop string: its index and that string."""

    index: int
    word: str


def stop_words(stop: object) -> list[str]:
    """The request's stop strings (``stop`` may be a string or a list)."""
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return []
    return [s for s in stop if isinstance(s, str) and s]


def stop_match(stop: object, n: int, chat: bool) -> StopMatch | None:
    """The first token (< n) whose text contains a stop string, else None."""
    words = stop_words(stop)
    if not words:
        return None
    for i in range(min(n, 7)):
        t = token_text(i, chat)
        for w in words:
            if w in t:
                return StopMatch(i, w)
    return None


def tokenize(text: str) -> list[int]:
    """Deterministic fake tokenization: one token per 4 chars (at least one for non-empty text)."""
    if not text:
        return []
    n = max(1, len(text) // 4)
    data = text.encode()
    step = max(1, len(data) // n)
    return [sum(data[k * step : (k + 1) * step]) % N_VOCAB for k in range(n)]


def detokenize(ids: list[object]) -> str:
    return "".join(ID_TO_PIECE.get(t, "") if isinstance(t, int) else "" for t in ids)


def embedding(text: str, dim: int = 8) -> list[float]:
    seed = sum(text.encode()) + len(text)
    return [((seed * (j + 3) * 2654435761) % 2000) / 1000.0 - 1.0 for j in range(dim)]
