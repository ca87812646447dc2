"""Per-session token contexts held in memory, bounded in bytes (issue 49).

Two processes remember each session's last context: the HTTP process (a hint can name
a session, `sessions.hints.HintBook`) and every scheduler rank (patch session-guard
protects open sessions' device contexts). A context is an `array('i')` (4 bytes a
token: token ids are below 2**31) instead of a Python int list (~36 bytes a token),
and the book forgets its least recently used contexts past a byte budget as well as
past a number of sessions. A context larger than the whole budget is not kept.

Figures (4 bytes a token): two 256K-token agents hold 2 MiB; 1,024 sessions of 10K
tokens hold 40 MiB; the default budget, 64 MiB a book, caps any mix.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

DEFAULT_MAX_BYTES = 64 * 2**20


def tokens_array(ids: Iterable[int]) -> array:
    """`ids` as 4-byte tokens (8 bytes only if some id does not fit 32 bits)."""
    seq = ids if isinstance(ids, (list, tuple, array)) else list(ids)
    try:
        return array("i", seq)
    except OverflowError:
        return array("q", seq)


class ContextBook:
    """sid -> (tokens, meta), least recently stored first, bounded in entries and bytes."""

    def __init__(self, max_entries: int, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[array, Any]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, sid: object) -> bool:
        return sid in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, sid: str, ids: Iterable[int], meta: Any = None) -> None:
        tokens = tokens_array(ids)
        self.pop(sid)
        size = tokens.itemsize * len(tokens)
        if size > self.max_bytes:
            return  # larger than the whole budget: not kept
        self._items[sid] = (tokens, meta)
        self._bytes += size
        while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
            _, (old, _) = self._items.popitem(last=False)
            self._bytes -= old.itemsize * len(old)

    def tokens(self, sid: str) -> array | None:
        item = self._items.get(sid)
        return None if item is None else item[0]

    def meta(self, sid: str) -> Any:
        item = self._items.get(sid)
        return None if item is None else item[1]

    def get(self, sid: str) -> list[int] | None:
        """The context as a list of ints (a copy), or None."""
        t = self.tokens(sid)
        return None if t is None else t.tolist()

    def pop(self, sid: str) -> None:
        item = self._items.pop(sid, None)
        if item is not None:
            self._bytes -= item[0].itemsize * len(item[0])
