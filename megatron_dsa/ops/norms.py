"""RMSNorm as a pure function (statistics in at least float32)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    """`x · rsqrt(mean(x², -1) + eps) · weight` over the last dim; `weight=None` is weightless.

    Half-precision inputs are normalised in float32 and rounded once at the end.
    """
    compute = x if x.dtype in (torch.float32, torch.float64) else x.float()
    y = compute * torch.rsqrt(compute.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)
