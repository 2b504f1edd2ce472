"""The accumulation dtype every op shares."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics, scores and sums of `dtype` inputs are computed in this: float64 for float64 (the
    exact reference for tests), float32 for everything else (16-bit inputs are upcast once)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
