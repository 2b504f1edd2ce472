"""Tile arithmetic shared by the Triton launchers (host side, no Triton import)."""

from __future__ import annotations

import torch

MIN_DOT = 16  # `tl.dot` needs every operand side >= 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(size: int, floor: int = 1, cap: int = 1 << 30) -> int:
    """The smallest power of two >= size, clamped to `[floor, cap]`: a block that covers `size`."""
    return min(cap, max(floor, 1 << max(0, size - 1).bit_length()))


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: float32 follows torch's own matmul setting (exact unless TF32 is
    allowed there); 16-bit inputs ignore it."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"
