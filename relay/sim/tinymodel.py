"""The tiny model the simulator pretends to serve: its vocabulary, its text, what it computes.

It writes " Hello from a tiny llama." over and over (chat starts at "Hello"), one token a
word; stop words are matched against that text; a tool call's arguments stream in runs of word
and other characters. Its tokenizer, detokenizer and embeddings are deterministic stand-ins
with the real server's output types. Pure functions, no I/O.

A prompt's tokens, what a slot's cache holds and compares (slots.py), come from
`raw_prompt_tokens` (a raw prompt) and `template_tokens` (the turns of a conversation, as a chat
template renders them):

- Text is a token per 4 characters, the last token taking the 1..7 left over (so a text's
  tokens are a prefix of a longer text's at every multiple of 4 characters but its last); the
  model's own text in an assistant turn is read back as the tokens it generated, one per word.
- A turn's parts, in order: text, tool calls (the name a token, then the arguments' canonical
  JSON as text), tool results, tool definitions (their JSON as text), and any other part
  (an image, audio, a file) one token, its digest.
- The template's role markers cost no token of their own: a turn's first token carries its
  role, so a user "Hi" and an assistant "Hi" differ, and one turn's tokens are those of its
  text alone (a one-message prompt counts a token per 4 characters, as the simulator always
  has). A turn with nothing in it is one token, its marker. The generation prompt (the
  assistant's marker) rides on the first generated token in the same way, so a reply stored
  in a slot is the tokens its next-turn rendering as an assistant turn starts with.
- A token is an int: a word of the model by its vocabulary id, any other piece by its text
  read as a big-endian number (distinct pieces, distinct tokens: a common prefix is exact).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import msgspec

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
# "<s>" of the tiny model: the one token of an empty prompt.
BOS_ID = 1
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


class PartKind(Enum):
    """What a part of a turn is: text, a tool call, a tool's result, the tool definitions, or
    anything else the model reads (an image, audio, a file), which is one token."""

    TEXT = "text"
    CALL = "call"
    RESULT = "result"
    TOOLS = "tools"
    MEDIA = "media"


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a turn: its text (a call's arguments, a medium's canonical JSON), and a
    call's tool name."""

    kind: PartKind
    text: str
    name: str = ""


@dataclass(frozen=True, slots=True)
class Turn:
    """One message as a chat template renders it: its role, then its parts in order."""

    role: str
    parts: tuple[Part, ...]


# The model's own words, longest first (no word is a prefix of another).
_WORDS = sorted(TOKEN_IDS, key=len, reverse=True)
_canon = msgspec.json.Encoder()


def _piece_id(*fields: str) -> int:
    """The token of a piece that is not a word of the model: its fields' text as a number."""
    return int.from_bytes("\x1f".join(fields).encode(), "big")


def _own_words(text: str) -> list[int] | None:
    """`text` as the model's words (what it generated), or None if it is not made of them."""
    out: list[int] = []
    i = 0
    while i < len(text):
        for w in _WORDS:
            if text.startswith(w, i):
                out.append(TOKEN_IDS[w])
                i += len(w)
                break
        else:
            return None
    return out


def text_tokens(text: str, own: bool = False) -> list[int]:
    """A text's tokens: one per 4 characters, the last taking what is left over; with `own`
    (an assistant's text), the model's words as it generated them where the text is only
    those."""
    if own:
        words = _own_words(text)
        if words is not None:
            return words
    n = len(text) // 4
    if n <= 1:
        return [_piece_id("t", text)] if text else []
    last = 4 * (n - 1)
    return [_piece_id("t", text[k : k + 4]) for k in range(0, last, 4)] + [
        _piece_id("t", text[last:])
    ]


def call_arguments(value: object) -> str:
    """A tool call's arguments as the template writes them: compact JSON of the value (a JSON
    text is parsed first); a text that is not JSON, as it is."""
    if isinstance(value, str):
        text = value
        try:
            value = msgspec.json.decode(text)
        except msgspec.DecodeError:
            return text
    try:
        return _canon.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        return ""


def digest(value: object) -> str:
    """A part the model reads as one token (an image, ...): the digest of its JSON."""
    try:
        raw = _canon.encode(value)
    except (TypeError, msgspec.EncodeError):
        raw = b""
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def tools_part(tools: object) -> list[Part]:
    """The tool definitions a template renders (none for no tools): their JSON as text."""
    return [Part(PartKind.TOOLS, call_arguments(tools))] if tools else []


# What an API makes of a content block other than text (None: a medium, one token).
Blocks = Callable[[dict[str, object]], list[Part] | None]


def content_parts(content: object, blocks: Blocks | None = None) -> list[Part]:
    """A message's content as parts: a string is one text; in a list, adjacent text blocks
    (any with a string ``text``) are one text, and any other block is what `blocks` makes of
    it, else one medium (its digest, ``cache_control`` left out)."""
    if isinstance(content, str):
        return [Part(PartKind.TEXT, content)] if content else []
    if not isinstance(content, list):
        return []
    out: list[Part] = []
    texts: list[str] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        text = block.get("text")
        if isinstance(text, str):
            texts.append(text)
            continue
        if texts:
            out.append(Part(PartKind.TEXT, "".join(texts)))
            texts = []
        made = blocks(block) if blocks is not None else None
        if made is None:
            bare = {k: v for k, v in block.items() if k != "cache_control"}
            made = [Part(PartKind.MEDIA, digest(bare))]
        out.extend(made)
    if texts:
        out.append(Part(PartKind.TEXT, "".join(texts)))
    return out


def with_head(turns: list[Turn], head: list[Part]) -> list[Turn]:
    """`head` (the system text, the tools) as the first turn, a system one, joined to a
    leading system or developer turn."""
    if turns and turns[0].role in ("system", "developer"):
        return [Turn(turns[0].role, turns[0].parts + tuple(head)), *turns[1:]]
    return [Turn("system", tuple(head)), *turns] if head else turns


def _part_tokens(part: Part, own: bool) -> list[int]:
    kind = part.kind
    if kind is PartKind.TEXT:
        return text_tokens(part.text, own)
    if kind is PartKind.CALL:
        return [_piece_id("call", part.name), *text_tokens(part.text)]
    if kind is PartKind.RESULT:
        toks = text_tokens(part.text)
        return [_piece_id("result", f"{toks[0]:x}"), *toks[1:]] if toks else [_piece_id("result")]
    if kind is PartKind.TOOLS:
        return text_tokens(part.text)
    return [_piece_id("media", part.text)]


def turn_tokens(turn: Turn) -> list[int]:
    """One turn's tokens, its first one carrying the turn's role."""
    own = turn.role == "assistant"
    toks = [t for p in turn.parts for t in _part_tokens(p, own)]
    if not toks:
        return [_piece_id("turn", turn.role)]
    toks[0] = _piece_id("turn", turn.role, f"{toks[0]:x}")
    return toks


def template_tokens(turns: list[Turn]) -> list[int]:
    """The tokens of a conversation rendered by the chat template (BOS alone for none)."""
    toks = [t for turn in turns for t in turn_tokens(turn)]
    return toks or [BOS_ID]


def raw_prompt_tokens(prompt: object) -> list[int]:
    """The tokens of a raw prompt (/completion, /v1/completions): a string's text tokens; a
    list's token ids as given and its strings' text tokens, in order; BOS alone for none."""
    if isinstance(prompt, str):
        toks = text_tokens(prompt)
    elif isinstance(prompt, list):
        toks = []
        for x in prompt:
            if isinstance(x, int) and not isinstance(x, bool):
                toks.append(x)
            elif isinstance(x, str):
                toks.extend(text_tokens(x))
            else:
                toks.append(_piece_id("media", digest(x)))
    else:
        toks = []
    return toks or [BOS_ID]


def generated_tokens(n: int, chat: bool) -> list[int]:
    """The ids of the first `n` tokens the model generates."""
    return [TOKEN_IDS[token_text(i, chat)] for i in range(n)]
