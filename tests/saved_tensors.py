"""Bug class A1.1: a tensor autograd saved must be unchanged when backward reads it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor


class SavedTensorGuard:
    """saved_tensors_hooks that remember `(t, t._version, t.clone())` and check them at unpack.

    Both checks are needed: a kernel writing through a raw pointer does not bump `_version`.
    `tensors` lists what was saved, so a test can also check *what* an autograd Function saved."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.unpacked = 0

    @property
    def packed(self) -> int:
        return len(self.tensors)

    def pack(self, tensor: Tensor):
        self.tensors.append(tensor)
        return tensor, tensor._version, tensor.clone()

    def unpack(self, saved) -> Tensor:
        tensor, version, copy = saved
        self.unpacked += 1
        assert tensor._version == version, "a tensor saved for backward was modified in place"
        torch.testing.assert_close(tensor, copy, rtol=0, atol=0, equal_nan=True,
                                   msg="a tensor saved for backward changed its values")
        return tensor

    @contextmanager
    def watching(self) -> Iterator["SavedTensorGuard"]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self
