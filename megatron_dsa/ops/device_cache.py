"""A small per-process cache for values built on a device (index tensors, constant matrices, scalars).

Such values are pure functions of their key (shape, dtype, device), so every layer and step can share
one. The one exception is a value built while a CUDA graph is being captured: its storage belongs to the
graph's private memory pool and holds its values only in that graph's replays, so it is returned but
never kept.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, Optional, TypeVar

import torch

Value = TypeVar("Value")


def capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is capturing a graph and `device` is a CUDA device."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


class DeviceCache(Generic[Value]):
    """`get(key, device, build)`: the value kept for `key`, else `build()` (kept unless capturing).

    `max_entries` bounds the cache; the oldest entry goes first."""

    def __init__(self, max_entries: Optional[int] = None) -> None:
        self._entries: dict[Hashable, Value] = {}
        self._max_entries = max_entries

    def get(self, key: Hashable, device: torch.device, build: Callable[[], Value]) -> Value:
        value = self._entries.get(key)
        if value is not None:
            return value
        value = build()
        if not capturing(device):
            if self._max_entries is not None and len(self._entries) >= self._max_entries:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = value
        return value
