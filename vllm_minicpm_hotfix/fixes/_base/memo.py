"""The memo the fixes' behaviours keep per-request values in, keyed by the vLLM objects those values come from.

Nothing here imports vLLM, torch or transformers.
"""

from __future__ import annotations

import weakref
from typing import Any


class WeakMemo:
    """A bounded memo of values computed per request from objects vLLM builds once and keeps (its processors, its
    tokenizer), for behaviours on the request path. A key names those objects by ``id()``; the entry keeps weak
    references to them and counts only while they are still those very objects, so an id is never taken for a later
    object's and nothing is kept alive. Objects that cannot be weakly referenced are not memoised. Cleared when
    ``limit`` entries are held."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._entries: dict[Any, tuple[tuple[Any, ...], Any]] = {}

    def get(self, key: Any, objects: tuple[Any, ...] = ()) -> Any:
        """The value kept for ``key`` and ``objects``, else None. Raises ``TypeError`` for an unhashable key."""
        hit = self._entries.get(key)
        if hit is None:
            return None
        for ref, obj in zip(hit[0], objects):
            if ref() is not obj:
                return None
        return hit[1]

    def put(self, key: Any, objects: tuple[Any, ...], value: Any) -> None:
        """Keep ``value`` (not None) for ``key`` while ``objects`` live."""
        try:
            refs = tuple(weakref.ref(obj) for obj in objects)
        except TypeError:  # not weakly referenceable: not kept
            return
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[key] = (refs, value)
