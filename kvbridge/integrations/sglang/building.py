"""The SGLang queue building a kvbridge manager on this thread (``PrefillBootstrapQueue`` /
``DecodePreallocQueue``, whose ``_init_kv_manager`` patches.py wraps): what ``KVArgs`` do not
say about a hybrid model (an SWA pool's window and layers) is read off it
(``state_kinds.geometry_of``)."""

from __future__ import annotations

import threading
from typing import Any

_BUILDING = threading.local()

__all__ = ["building", "building_queue"]


class building:
    """``with building(queue):`` names the SGLang queue building a manager on this thread."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __enter__(self) -> Any:
        self.saved = getattr(_BUILDING, "queue", None)
        _BUILDING.queue = self.queue
        return self.queue

    def __exit__(self, *exc: Any) -> None:
        _BUILDING.queue = self.saved


def building_queue() -> Any:
    """The SGLang queue whose ``_init_kv_manager`` runs on this thread, or None."""
    return getattr(_BUILDING, "queue", None)
