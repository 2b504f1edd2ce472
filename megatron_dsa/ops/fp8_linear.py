"""Projections with FP8 GEMMs: `x @ Wᵀ`, forward and backward, with both operands of every product rounded to
FP8 e4m3 with one scale per row of the contraction (docs/user_guide.md, 'FP8 projections').

One FP8 GEMM `a·bᵀ` (`a [M, K]`, `b [N, K]`) rounds each row of `a` and of `b` (K values) to e4m3 after
dividing it by its own scale `amax(|row|) / 448`, so that the row's largest value lands on e4m3's largest
(448), and multiplies the rounded values back by the scales: `(a·bᵀ)[m, n] = s_a[m]·s_b[n]·Σ_k qa[m, k]·qb[n, k]`.
The scales are along the rows that are *not* summed over, which is what torch's rowwise-scaled
`_scaled_mm` takes (`scale_a [M, 1]`, `scale_b [1, N]`), so each of a linear's three GEMMs quantizes its
operands along its own contraction:

| GEMM | a | b | each scale covers |
|---|---|---|---|
| forward `y = x·Wᵀ` | x `[T, K]` | W `[N, K]` | a token's row; an output feature's row of W |
| input grad `dx = dy·W` | dy `[T, N]` | Wᵀ `[K, N]` | a token's gradient row; an input feature's column of W |
| weight grad `dW = dyᵀ·x` | dyᵀ `[N, T]` | xᵀ `[K, T]` | an output feature's gradient over the tokens; an input feature over the tokens |

Gradients are e4m3 too, not e5m2: with a scale per row, a row's largest value sets its range, so e5m2's
wider exponent range would only keep values below `amax·2⁻¹⁷` (a negligible share of a dot product), while
its 2 mantissa bits double the rounding of every value (2⁻³ against e4m3's 2⁻⁴ relative); DeepSeek-V3 trains
with e4m3 gradients under fine-grained scales for the same reason.

`fp8_gemm_reference` is the readable definition (rounded, then multiplied in float32, or float64 for
float64 rows); a fused backend (`backends.torch_scaled_mm`) must agree with it up to the order of its
fp32 accumulation. `Fp8Linear` takes the GEMM as an argument (`ops` never imports `backends`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch
from torch import Tensor

from megatron_dsa.device_cache import KeptWhileUnchanged
from megatron_dsa.ops.precision import compute_dtype

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


class Fp8Gemm(Protocol):
    """`(a [M, K], b [N, K], out_dtype)` → `a·bᵀ [M, N]` in `out_dtype`, each row of a and of b rounded to
    FP8 with its own scale (the `fp8_gemm` op family). With `b_scales [N, 1]`, b is already rounded: the
    e4m3 codes `quantize_rows` made of it, standing for `b·b_scales` (a weight rounded once and kept). Kept
    codes may come in G groups, b `[G, N, K]` with `b_scales [G, N, 1]` and a `[M, G·K]`: the G products
    `a_g·b_gᵀ` side by side, `[M, G·N]` (a grouped projection's weight kept rounded, in one call)."""

    def __call__(self, a: Tensor, b: Tensor, out_dtype: torch.dtype, b_scales: Optional[Tensor] = None) -> Tensor: ...


def quantize_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """`t [R, K]` (any strides) → `(q [R, K]` e4m3 (row-major), `scale [R, 1]` in t's compute dtype): `q =
    t / scale` rounded to nearest, `scale = amax(|row|) · (1/448)` (a zero row keeps zeros). Non-finite values
    give a non-finite scale, so they reach the product instead of being clipped away."""
    compute = compute_dtype(t.dtype)
    amax = torch.linalg.vector_norm(t, float("inf"), dim=1, keepdim=True, dtype=compute)  # one pass, no |t| copy
    # Times the rounded reciprocal, as torch's CUDA division by a Python number computes it: the same numbers
    # on every device (a true division would differ from the GPU's in the last bit of some scales).
    scale = amax.clamp_min(torch.finfo(compute).tiny) * (1.0 / FP8_MAX)
    # The clamp only catches a last-ulp overshoot of the quotient (e4m3fn has no inf: beyond 448 is NaN).
    q = (t / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8, memory_format=torch.contiguous_format)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor) -> Tensor:
    """The values `q·scale` that `quantize_rows` stands for, in the scale's dtype."""
    return q.to(scale.dtype) * scale


def rounded_rows(t: Tensor) -> Tensor:
    """`t [..., K]` rounded to e4m3 with one scale per row of its last dim (`quantize_rows`), back as the values
    the codes stand for, in t's compute dtype (float32 for 16-bit t: the code times its scale is not always a
    16-bit number)."""
    return dequantize_rows(*quantize_rows(t.flatten(0, -2))).view(t.shape)


def fp8_gemm_reference(a: Tensor, b: Tensor, out_dtype: torch.dtype, b_scales: Optional[Tensor] = None) -> Tensor:
    """The `fp8_gemm` contract, readably: a's and b's rows rounded to FP8 (`quantize_rows`; b's already, where
    `b_scales` comes with its codes), multiplied back by their scales and `a·bᵀ` computed in float32 (float64
    for float64 rows); `[M, N]` in `out_dtype` (grouped kept codes: `[M, G·N]`, group by group)."""
    if b.dim() == 3:
        return group_by_group(fp8_gemm_reference, a, b, out_dtype, b_scales)
    rounded_a = rounded_rows(a)
    rounded_b = rounded_rows(b) if b_scales is None else dequantize_rows(b, b_scales)
    compute = torch.promote_types(rounded_a.dtype, rounded_b.dtype)
    return (rounded_a.to(compute) @ rounded_b.to(compute).t()).to(out_dtype)


def group_by_group(gemm: Fp8Gemm, a: Tensor, codes: Tensor, out_dtype: torch.dtype, scales: Tensor) -> Tensor:
    """Grouped kept codes (`codes [G, N, K]`, `scales [G, N, 1]`, a `[M, G·K]`) through `gemm` one group at a time:
    the G products side by side, `[M, G·N]`."""
    return torch.cat([gemm(rows, group_codes, out_dtype, group_scales)
                      for rows, group_codes, group_scales in zip(a.chunk(codes.shape[0], dim=1), codes, scales)], dim=1)


def _groups(t: Tensor, groups: int) -> tuple[Tensor, ...]:
    """`[T, G·w]` → G views `[T, w]` (no copy)."""
    return t.chunk(groups, dim=1) if groups > 1 else (t,)


def _side_by_side(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class Fp8Linear(torch.autograd.Function):
    """`x [T, G·K]`, `weight [G, N, K]` → `[T, G·N]` in `out_dtype`: group g's columns are `x_g·W_gᵀ` (one
    group: a plain linear), every GEMM of forward and backward through `gemm` (see the module docstring).

    Only the first `grad_rows` rows of each `W_g` pass a gradient to x (the outputs of the others read x as
    if detached: `ops.stacked_projection`'s `attached`). x and weight are saved as they are (no FP8 copy:
    the weight gradient needs x rounded along the tokens, not along its rows); x's gradient comes in x's
    dtype, the weight's in the weight's. Autocast is off inside: `gemm` owns the precision of its product.
    `rounded`: the weight already rounded (`RoundedWeight`), which the forward then multiplies by instead of
    rounding it again (the same numbers), all groups in one `gemm` call.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, grad_rows: int, gemm: Fp8Gemm, out_dtype: torch.dtype,
                rounded: Optional["RoundedWeight"] = None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.grad_rows, ctx.gemm = grad_rows, gemm
        groups = _groups(x, weight.shape[0])
        with torch.autocast(x.device.type, enabled=False):
            if rounded is None:
                return _side_by_side([gemm(rows, w, out_dtype) for rows, w in zip(groups, weight)])
            if len(groups) > 1:  # kept codes: every group in one call
                return gemm(x, rounded.codes, out_dtype, rounded.scales)
            return gemm(x, rounded.codes[0], out_dtype, rounded.scales[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        gemm, rows = ctx.gemm, ctx.grad_rows
        grads, inputs = _groups(grad, weight.shape[0]), _groups(x, weight.shape[0])
        grad_x = grad_weight = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0] and rows > 0:
                grad_x = _side_by_side([gemm(g[:, :rows], w[:rows].t(), x.dtype) for g, w in zip(grads, weight)])
            if ctx.needs_input_grad[1]:
                grad_weight = torch.stack([gemm(g.t(), rows_in.t(), weight.dtype)
                                           for g, rows_in in zip(grads, inputs)])
        return grad_x, grad_weight, None, None, None, None


class RoundedWeight(NamedTuple):
    """A weight `[G, N, K]` (G = 1: a plain linear's) as `quantize_rows` rounds it: e4m3 `codes [G, N, K]`
    standing for `codes · scales`, `scales [G, N, 1]` (one per row of each group)."""

    codes: Tensor
    scales: Tensor

    @classmethod
    def of(cls, weight: Tensor) -> "RoundedWeight":
        """`weight [N, K]` or `[G, N, K]` rounded (no gradient)."""
        with torch.no_grad():
            codes, scales = quantize_rows(weight.reshape(-1, weight.shape[-1]))
        groups = weight.shape[0] if weight.dim() == 3 else 1
        return cls(codes.view(groups, -1, weight.shape[-1]), scales.view(groups, -1, 1))

    def in_groups(self, groups: int) -> "RoundedWeight":
        """The same rows as `[groups, N / groups, K]` (a grouped weight `[G·N, K]` rounded row by row)."""
        return RoundedWeight(self.codes.view(groups, -1, self.codes.shape[-1]), self.scales.view(groups, -1, 1))


class RoundedWeights:
    """`RoundedWeight.of` each weight, kept between calls while the weight is the same tensor, unchanged in place
    (`KeptWhileUnchanged`: an optimizer step or `load_state_dict` makes the next call round it again). An inference
    cache holds one (`layers.decoding.LayerCache`), as it holds its `KeptStack`: its codes live as long as it does.
    Each entry holds its weight, so that no other tensor can take the weight's identity while the entry lives."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Tensor, KeptWhileUnchanged[RoundedWeight]]] = {}

    def of(self, weight: Tensor) -> RoundedWeight:
        entry = self._kept.get(id(weight))
        if entry is None or entry[0] is not weight:
            entry = self._kept[id(weight)] = (weight, KeptWhileUnchanged())
        return entry[1].get([weight], lambda: RoundedWeight.of(weight))

    def __len__(self) -> int:
        return len(self._kept)


def fp8_linear(x: Tensor, weight: Tensor, gemm: Fp8Gemm, grad_rows: Optional[int] = None,
               out_dtype: Optional[torch.dtype] = None, rounded: Optional[RoundedWeight] = None) -> Tensor:
    """`x [..., K] @ weight [N, K]ᵀ` → `[..., N]` in `out_dtype` (default x's), every GEMM of forward and
    backward in FP8 through `gemm` (an `fp8_gemm` implementation). The outputs of weight rows `grad_rows`
    onwards pass no gradient to x (default: all do). `rounded`: `RoundedWeight.of(weight)`, kept by the
    caller (the forward then does not round the weight again)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [..., K] "
                         f"and [N, K]")
    rows = weight.shape[0] if grad_rows is None else grad_rows
    if not 0 <= rows <= weight.shape[0]:
        raise ValueError(f"fp8_linear grad_rows must be in [0, {weight.shape[0]}], got {grad_rows}")
    _check_rounded(rounded, weight, expected=(1, *weight.shape))
    out = Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight.unsqueeze(0), rows, gemm, out_dtype or x.dtype, rounded)
    return out.view(*x.shape[:-1], weight.shape[0])


def fp8_grouped_linear(x: Tensor, weight: Tensor, gemm: Fp8Gemm, out_dtype: Optional[torch.dtype] = None,
                       rounded: Optional[RoundedWeight] = None) -> Tensor:
    """`x [T, G·K]`, `weight [G, N, K]` → `[T, G·N]` (group g: `x_g·W_gᵀ`) in `out_dtype` (default x's), as
    `fp8_linear` per group."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[0] * weight.shape[2]:
        raise ValueError(f"fp8_grouped_linear: x {tuple(x.shape)} must be [T, G·K] for weight [G, N, K] = "
                         f"{tuple(weight.shape)}")
    _check_rounded(rounded, weight, expected=weight.shape)
    return Fp8Linear.apply(x, weight, weight.shape[1], gemm, out_dtype or x.dtype, rounded)


def _check_rounded(rounded: Optional[RoundedWeight], weight: Tensor, expected: tuple[int, ...]) -> None:
    if rounded is not None and (rounded.codes.shape != expected or rounded.codes.dtype != FP8):
        raise ValueError(f"rounded weight codes {tuple(rounded.codes.shape)} {rounded.codes.dtype} must be the "
                         f"e4m3 rounding of weight {tuple(weight.shape)}")
