"""Partial rotary embeddings with the interleaved-pair convention (docs/math.md §2).

The last `P` dims of a head are `P/2` adjacent pairs `(x[2i], x[2i+1])`, rotated by `θ_i = pos·f_i`:
    y[2i]   = x[2i]·cos θ_i − x[2i+1]·sin θ_i
    y[2i+1] = x[2i+1]·cos θ_i + x[2i]·sin θ_i
and written back in the same interleaved slots. The first `D − P` dims pass through. The inverse
rotation uses `−sin`. Every function returns fresh storage: nothing here writes into its input, so a
tensor autograd saved is never changed (the inverse-RoPE-on-saved-output bug).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.ops.norms import rms_norm
from megatron_dsa.ops.precision import compute_dtype


def plain_inv_freq(rotary_dim: int, base: float, rotary_percent: float = 1.0) -> Tensor:
    """`f_i = base^(−2i/P')` for the first `P' = P·rotary_percent` dims; 0 (identity) for the rest.

    Returns `[P/2]` float64 on CPU.
    """
    _check_rotary_dim(rotary_dim)
    rotated = int(rotary_dim * rotary_percent) // 2 * 2
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    freq = base ** (-2.0 * i / max(rotated, 1))
    return torch.where(i < rotated // 2, freq, torch.zeros_like(freq))


def yarn_correction_range(rotary_dim: int, base: float, original_max_position: int,
                          beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """`(low, high)` pair indices of the YaRN ramp (e.g. 17, 28 for P=64, base 40000, L0 65536)."""

    def correction_dim(num_rotations: float) -> float:
        return rotary_dim * math.log(original_max_position / (2 * math.pi * num_rotations)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rotary_dim - 1)
    return float(low), float(high)


def yarn_inv_freq(rotary_dim: int, base: float, scaling_factor: float, original_max_position: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> Tensor:
    """YaRN frequencies `f_inter·ramp + f_extra·(1 − ramp)`, `[P/2]` float64 on CPU.

    Only the frequencies: the magnitude factor (mscale) is never baked in here (DSv4 "pure rotation").
    """
    _check_rotary_dim(rotary_dim)
    extra = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    inter = extra / scaling_factor
    low, high = yarn_correction_range(rotary_dim, base, original_max_position, beta_fast, beta_slow)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inter * ramp + extra * (1 - ramp)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype,
                 amplitude: float = 1.0) -> tuple[Tensor, Tensor]:
    """`cos θ, sin θ` for `positions [*]` → `[*, P/2]` each, cast to `dtype`.

    Angles are computed in float64 when `dtype` is float64, else in float32 (then cast, as Megatron).
    """
    angle_dtype = compute_dtype(dtype)
    angles = positions.to(angle_dtype).unsqueeze(-1) * inv_freq.to(positions.device, angle_dtype)
    return (torch.cos(angles) * amplitude).to(dtype), (torch.sin(angles) * amplitude).to(dtype)


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the last `P = 2·cos.shape[-1]` dims of `x [..., Dh]` (interleaved pairs).

    `cos`/`sin` `[..., P/2]` broadcast against `x[..., :P/2]` (e.g. `[T, 1, P/2]` for `x [T, H, Dh]`).
    Returns a new tensor; `x` is not modified.
    """
    half = cos.shape[-1]
    if x.shape[-1] < 2 * half:
        raise ValueError(f"rotary dims (2*{half}) exceed the head dim {x.shape[-1]}")
    nope, pe = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    even, odd = pe.unflatten(-1, (half, 2)).unbind(-1)
    if inverse:
        sin = -sin
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated), dim=-1)


def rope(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
         amplitude: float = 1.0) -> Tensor:
    """Convenience: rotate `x [T, Dh]` or `x [T, H, Dh]` at `positions [T]` (new storage).

    Compressed entry `j` passes position `j·r` (docs/math.md §2.6).
    """
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype, amplitude)
    if x.dim() == positions.dim() + 2:  # a head axis between rows and dims
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return apply_partial_rope(x, cos, sin, inverse=inverse)


def norm_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, eps: float, weight: Optional[Tensor] = None) -> Tensor:
    """RMSNorm over the last dim, then RoPE: `rope(rms_norm(x, weight, eps), positions, inv_freq)`.

    `x [T, Dh]` or `[T, H, Dh]`, `positions [T]`, `inv_freq [P/2]`, `weight [Dh]` or None (weightless)
    → a new tensor shaped like x (the per-head query path of the W/C/H kinds, weightless, and the
    compressor's entries, weighted; fused kernels implement exactly this composition).
    """
    return rope(rms_norm(x, weight, eps), positions, inv_freq)


def _check_rotary_dim(rotary_dim: int) -> None:
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary dim must be a positive even number, got {rotary_dim}")
