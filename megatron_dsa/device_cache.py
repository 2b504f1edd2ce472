"""Keeping values built on a device (index tensors, constant matrices, scalars) for reuse.

`DeviceCache` is a small per-process cache: such values are pure functions of their key (shape, dtype,
device), so every layer and step can share one. `KeepsDeviceValues` and `device_cached_property` do the
same per object, for layouts that every layer and step of a shape share; `KeptWhileUnchanged` keeps a
value derived from tensors that may change (weights) while they do not. The one exception is a value
built while a CUDA graph is being captured: its storage belongs to the graph's private memory pool and
holds its values only in that graph's replays, so it is returned but not kept by anything that outlives
the capture. A value built while `torch.compile` traces is a value of the graph being built, not a tensor
to keep, and is treated the same way. A value built under `torch.inference_mode()` is built outside it
(`built_for_keeping`), so that a training step after an evaluation can use it.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Callable, Generic, Hashable, Optional, Sequence, TypeVar

import torch
from torch import Tensor

Value = TypeVar("Value")


def capturing_now() -> bool:
    """True while the current CUDA stream is capturing a graph (on any CUDA device)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is capturing a graph and `device` is a CUDA device."""
    return torch.device(device).type == "cuda" and capturing_now()


def building_graph_now() -> bool:
    """True while a CUDA graph is being captured or `torch.compile` traces."""
    return torch.compiler.is_compiling() or capturing_now()


_BUILT_CAPTURING = "_built_while_capturing"


def built_for_keeping(build: Callable[[], Value]) -> Value:
    """`build()`, outside `torch.inference_mode()` where it is on: a kept value outlives the call that built it,
    and a later training step may save it for backward, which autograd refuses for an inference tensor (an
    evaluation under inference mode, then training, would otherwise fail at the first cached table)."""
    # (The trace first: Dynamo cannot trace the inference-mode query; a traced value is not kept anyway.)
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return build()
    return build()


class KeepsDeviceValues:
    """Base of (frozen) dataclasses that keep values built on a device from their fields, in
    `device_cached_property`s or by hand: it records whether the object itself was built during a capture."""

    def __post_init__(self) -> None:
        self.__dict__[_BUILT_CAPTURING] = building_graph_now()

    def may_keep_values_built_now(self) -> bool:
        """No capture or trace is running, or this object was built inside it (then it lives and dies with
        the capture, and so do its values)."""
        return self.__dict__.get(_BUILT_CAPTURING, False) or not building_graph_now()

    def kept(self, store: dict, key: Hashable, build: Callable[[], Any]) -> Any:
        """`store[key]`, else `build()`, kept in `store` (a dict of this object's) when
        `may_keep_values_built_now()`."""
        if key in store:
            return store[key]
        value = built_for_keeping(build)
        if self.may_keep_values_built_now():
            store[key] = value
        return value


class device_cached_property(cached_property):  # noqa: N801 - used like functools.cached_property
    """`functools.cached_property` for a `KeepsDeviceValues` object: a value first built while a CUDA graph
    is captured is returned but not kept, unless the object was built in that capture too. (Otherwise an
    object shared with eager steps, a uniform layout, would keep a tensor whose values exist only in the
    graph's replays.)"""

    def __get__(self, instance: Optional[KeepsDeviceValues], owner: Optional[type] = None) -> Any:
        if instance is None:
            return self
        return instance.kept(instance.__dict__, self.attrname, lambda: self.func(instance))


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
        value = built_for_keeping(build)
        # The trace first: Dynamo cannot trace the CUDA capture query (a graph break).
        if not (torch.compiler.is_compiling() or capturing(device)):
            if self._max_entries is not None and len(self._entries) >= self._max_entries:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = value
        return value


class KeptWhileUnchanged(Generic[Value]):
    """A value derived from some tensors (a stack of weights, a table in another dtype), kept while each of
    them is the same tensor with the same storage, shape, dtype and in-place version (an optimizer step or
    `load_state_dict` bumps the version), else built again. Built while a CUDA graph is captured or
    `torch.compile` traces: returned, not kept (and under a trace no identity is read: Dynamo cannot)."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._value: Optional[Value] = None

    def get(self, sources: Sequence[Tensor], build: Callable[[], Value]) -> Value:
        if torch.compiler.is_compiling() or any(t.is_inference() for t in sources):
            return build()  # (an inference tensor has no version counter to tell a change by)
        key = tuple((id(t), t.data_ptr(), t._version, t.shape, t.dtype, t.device) for t in sources)
        if key == self._key:
            return self._value
        value = built_for_keeping(build)
        if not capturing_now():
            self._key, self._value = key, value
        return value


_SCALARS: DeviceCache[Tensor] = DeviceCache()


def device_scalar(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`[1]` tensor holding `value` in `dtype` on `device`, made once per value by a fill kernel (no
    host-to-device copy: no sync, CUDA-graph capturable) and kept, except while a CUDA graph is being
    captured; so a layer step does not launch one fill per op. Readers never write into it.

    Kernels read scalars through such a pointer where a kernel argument would lose precision (Triton passes
    float scalars as fp32: a float64 RMSNorm eps, the RoPE amplitude)."""
    return _SCALARS.get((float(value), dtype, torch.device(device)), device,
                        lambda: torch.full((1,), float(value), dtype=dtype, device=device))
