"""Peak bytes of the tensors alive at once on CPU, counted by a dispatch mode (no allocator statistics
on the CPU): every tensor an op creates counts from its creation until its storage is freed."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """`peak`: the most bytes of op-created storages alive at once inside the mode (inputs made before
    it do not count); `saved`: bytes of the distinct storages autograd saved (`saved_tensors_hooks`).

    An op's output that shares the storage of a tensor made before the mode (a view, a slice) counts as a
    new storage of the whole size, unless that tensor is among `existing` (slicing inputs costs nothing)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {t.untyped_storage()._cdata: 0 for t in existing}
        self._saved: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in self._sizes:
                    self._sizes[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self._saved[storage._cdata] = storage.nbytes()
        return tensor

    @property
    def saved(self) -> int:
        return sum(self._saved.values())

    def __enter__(self) -> "LiveBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)
