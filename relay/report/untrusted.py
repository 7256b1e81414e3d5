"""Stored values are not to be trusted: a client names its model, its request id and more,
and another tool may write rows of its own to a shared table. Pure.

- `printable`: text as every human-readable form prints it (a table, the benchmark view,
  CSV, a line on stderr). A character that is not printable is escaped as Python spells it
  (`\\x1b`, `\\n`, `\\u202e`), and a backslash is doubled: a name cannot move the cursor,
  retitle the window, clear the screen or start a line of its own. JSON is left to JSON's own
  escaping.
- `checked`: the rows whose columns hold what the schema says (a number, finite, in a REAL
  or INTEGER column; text in a TEXT one; or NULL), and a `BadRow` for each of the others,
  which the report leaves out and names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from relay.store.schema import COLUMN_TYPES

# The escapes of the characters that have a short one.
_SHORT = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(c: str) -> str:
    if c in _SHORT:
        return _SHORT[c]
    if c.isprintable():
        return c
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def printable(text: str) -> str:
    """`text` with every character that is not printable escaped: the C0 controls (ESC, CR
    and LF among them), DEL, the C1 controls, and the other characters Python does not print
    (line separators, direction overrides). Printable text comes back as it is."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(map(_escaped, text))


class Want(Enum):
    """What a column holds, as the report says it when a row's does not."""

    NUMBER = "a finite number"
    TEXT = "text"


# Each stored column's kind, from the table's own types.
WANTS: dict[str, Want] = {c: Want.TEXT if t == "TEXT" else Want.NUMBER for c, t in COLUMN_TYPES}


def fits(value: object, want: Want) -> bool:
    """Whether a stored value is of its column's kind (NULL is of every kind). An integer is
    exact; a float is finite: an infinity would reach the figures and JSON has none."""
    if value is None:
        return True
    if want is Want.TEXT:
        return isinstance(value, str)
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


@dataclass(frozen=True, slots=True)
class BadRow:
    """A row left out: its id in the table (None: it has none) and its first wrong column."""

    row_id: int | str | None
    column: str

    def line(self) -> str:
        """The row named, its id as stored (`printable` is for the printer to apply)."""
        name = "without an id" if self.row_id is None else str(self.row_id)
        return f"row {name} skipped: {self.column} is not {WANTS[self.column].value}"


R = TypeVar("R", bound=Mapping[str, object])
# The types a column's values are of when every one fits (others: each value is looked at).
_PLAIN: dict[Want, frozenset[type]] = {
    Want.NUMBER: frozenset((type(None), int, float)),
    Want.TEXT: frozenset((type(None), str)),
}


def _all_fit(rows: Sequence[Mapping[str, object]], column: str) -> bool:
    """Whether every row's value of a column fits, read a column at a time: what a table
    written by the relay alone costs. False: some value may not, and each is looked at."""
    want = WANTS[column]
    types = {type(r.get(column)) for r in rows}
    if not types <= _PLAIN[want]:
        return False
    if want is Want.TEXT or float not in types:
        return True
    return all(map(math.isfinite, [v for r in rows if type(v := r.get(column)) is float]))


def checked(rows: Iterable[R], columns: Sequence[str], id_key: str) -> tuple[list[R], list[BadRow]]:
    """(the rows whose `columns` fit their kinds, in order; a BadRow for each other one,
    naming its first wrong column). `id_key`: the key that holds a row's id."""
    every = list(rows)
    suspect = [c for c in columns if not _all_fit(every, c)]
    if not suspect:
        return every, []
    good: list[R] = []
    bad: list[BadRow] = []
    for row in every:
        wrong = next((c for c in suspect if not fits(row.get(c), WANTS[c])), None)
        if wrong is None:
            good.append(row)
            continue
        rid = row.get(id_key)
        bad.append(BadRow(rid if isinstance(rid, (int, str)) else None, wrong))
    return good, bad
