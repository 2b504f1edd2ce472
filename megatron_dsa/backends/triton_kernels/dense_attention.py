"""Dense causal attention as Triton kernels, for the `M` kind's head dims (qk 448 + 64 / v 512 at dsv4's dims;
up to 576), which no vendor kernel takes (they stop at 256): the `dense_attention` family and the
context-parallel ring's `dense_attention_block_fwd` / `_bwd` (kernels: `_dense_attention_kernels`).

Same contracts as the unfused reference (`ops.dense_attention`): `q [T, H, Dqk]`, `k [T, G, Dqk]`,
`v [T, G, Dv]` with `G | H`, causal within each segment of a `TokenLayout` (a row sees the keys of its
segment up to itself; rows past the last boundary belong to the last segment, as FlashAttention-4 treats
them: `dense_layout`), natural-log LSE; a ring block is one diagonal (`causal`) or fully visible block.

Design: one program per (block of 64 query rows, head) in the forward and the query gradient, one per (block
of key rows, KV group) in the key and value gradients; each keeps one `[64, ≤ 512]` float32 accumulator,
the query (or key) block stays in shared memory as a dot operand, and the head dims are a power-of-two
chunk plus a tail (576 = 512 + 64). On CUDA a short autotune list picks the blocks, warps and stages per
(H, G, Dqk, Dv, causal, dtype); the CPU interpreter runs one small fixed configuration.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from megatron_dsa.backends.registry import OpFamily, count_variant
from megatron_dsa.backends.dense_layout import isolate_non_finite, varlen_boundaries
from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.tiles import cdiv, dot_precision, head_dim_chunks, on_device
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.precision import compute_dtype

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Every kernel holds a [64, D] float32 accumulator per program: past 576 it no longer fits the registers.
MAX_HEAD_DIM = 576
LOG2E = math.log2(math.e)
INTERPRETER_BLOCK = 16
BACKEND, VARIANT = "triton", "portable"

# CUDA autotune candidates (BLOCK_M, BLOCK_N, num_warps, num_stages), best first as an H200 timed them at qk 576
# / v 512 (bf16, 64 heads, S = 4096; `benchmarks/dense_attention.py --show-tuning`): forward 64 x 64 x 1
# stage 6.39 ms, 64 x 32 x 2 stages 6.63, 64 x 16 x 3 stages 9.08; query gradient 64 x 32 x 1 stage 12.9 ms,
# 64 x 16 x 2 stages 15.0; value gradient 32 x 64 x 2 stages 6.28 ms, x 1 stage 7.60, 16-row blocks 9.6 and
# more. The key gradient's two-stage candidate needs 272 KB of shared memory there and is skipped (it fails to
# launch), so it has a 16-row two-stage one (209 KB; untimed); the last candidates fit float32 inputs and GPUs
# with less shared memory.
FORWARD_CONFIGS = ((64, 64, 8, 1), (64, 32, 8, 2), (32, 32, 4, 1), (16, 16, 4, 1))
QUERY_GRAD_CONFIGS = ((64, 32, 8, 1), (64, 16, 8, 2), (32, 16, 4, 2), (16, 16, 4, 1))
KEY_VALUE_GRAD_CONFIGS = ((32, 64, 8, 2), (32, 64, 8, 1), (16, 64, 8, 2), (16, 32, 4, 2), (16, 16, 4, 1))


@dataclass(frozen=True)
class _Kernels:
    forward: Any
    query_grad: Any
    key_value_grad: Any
    autotuned: bool


def _configs(candidates: tuple[tuple[int, int, int, int], ...]) -> list:
    import triton

    return [triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n), num_warps=warps, num_stages=stages)
            for block_m, block_n, warps, stages in candidates]


@functools.lru_cache(maxsize=None)
def _build_kernels(interpret: bool) -> _Kernels:
    import triton

    from megatron_dsa.backends.triton_kernels import _dense_attention_kernels as source

    forward = triton.jit(source.dense_attention_fwd_kernel)
    query_grad = triton.jit(source.dense_attention_bwd_dq_kernel)
    key_value_grad = triton.jit(source.dense_attention_bwd_dkv_kernel)
    if interpret:
        return _Kernels(forward, query_grad, key_value_grad, autotuned=False)
    key = ["H", "G", "DQK", "DV", "CAUSAL"]  # the autotuner adds the tensor dtypes itself

    def tuned(kernel: Any, candidates: tuple, extra_key: tuple = ()) -> Any:
        return triton.autotune(_configs(candidates), key=key + list(extra_key))(kernel)

    return _Kernels(tuned(forward, FORWARD_CONFIGS), tuned(query_grad, QUERY_GRAD_CONFIGS),
                    tuned(key_value_grad, KEY_VALUE_GRAD_CONFIGS, ("KEY_GRAD",)), autotuned=True)


def _kernels() -> _Kernels:
    from triton import knobs

    return _build_kernels(bool(knobs.runtime.interpret))


def _launch(kernel: Any, autotuned: bool, blocks_along: str, rows: int, heads: int, *args: Any,
            **meta: Any) -> None:
    """One program per (block of `rows` along `BLOCK_M` or `BLOCK_N`, head or group)."""
    if not autotuned:
        meta.update(BLOCK_M=INTERPRETER_BLOCK, BLOCK_N=INTERPRETER_BLOCK, num_warps=4, num_stages=1)
    kernel[lambda config: (cdiv(rows, config[blocks_along]), heads)](*args, **meta)


# ---------------------------------------------------------------- operands
@dataclass(frozen=True)
class _Operands:
    """Kernel operands of one call: `q`, `k`, `v` with a unit column stride (row and head strides are
    passed), and per query row the first row of its segment (`starts`) and per key row the row after the
    end of its segment (`ends`), int32; both None for a fully visible block."""

    q: Tensor
    k: Tensor
    v: Tensor
    starts: Optional[Tensor]
    ends: Optional[Tensor]

    @property
    def causal(self) -> bool:
        return self.starts is not None

    def head_strides(self) -> tuple[int, ...]:
        return (*self.q.stride()[:2], *self.k.stride()[:2], *self.v.stride()[:2])

    def dims(self) -> dict[str, Any]:
        """The kernels' size arguments and tiles."""
        block_d, block_dt = head_dim_chunks(self.q.shape[2])
        block_v, block_vt = head_dim_chunks(self.v.shape[2])
        return dict(N=self.q.shape[0], M=self.k.shape[0], H=self.q.shape[1], G=self.k.shape[1], DQK=self.q.shape[2],
                    DV=self.v.shape[2], CAUSAL=self.causal, BLOCK_D=block_d, BLOCK_DT=block_dt, BLOCK_V=block_v,
                    BLOCK_VT=block_vt, DOT_PRECISION=dot_precision(self.q.dtype))

    def bound(self, which: Optional[Tensor]) -> Tensor:
        """`starts` or `ends`, or (fully visible block) any int32 tensor: the kernels do not read it."""
        return which if which is not None else self.q.new_zeros(1, dtype=torch.int32)


def _unit_columns(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D ([rows, heads, dim]), got shape {tuple(t.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one of float32/bfloat16/float16 for the Triton kernels, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype} (float64 runs on the unfused backend)")
    if k.shape[:2] != v.shape[:2] or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"(need k [m, G, Dqk], v [m, G, Dv] with G dividing H)")
    for name, dim in (("qk head dim", q.shape[2]), ("v head dim", v.shape[2])):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in [1, {MAX_HEAD_DIM}] for the Triton kernels, got {dim}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must share one device")


def segment_bounds(layout: TokenLayout) -> tuple[Tensor, Tensor]:
    """`(starts, ends)` int32 `[T]`: each row's segment start and the row after its segment's end (rows past
    the last boundary belong to the last segment, which then ends at `T`). Kept with the layout."""

    def build() -> tuple[Tensor, Tensor]:
        segment_ends = varlen_boundaries(layout)[0][1:]  # the last boundary moved to T, as FlashAttention's
        return layout.segment_starts.to(torch.int32), segment_ends[layout.segment_ids]

    return layout.derived("triton_dense_segment_bounds", build)


# ---------------------------------------------------------------- passes
def _forward(ops: _Operands, scale: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    rows, heads = ops.q.shape[:2]
    out = torch.empty(rows, heads, ops.v.shape[2], dtype=out_dtype, device=ops.q.device)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=ops.q.device)
    if rows == 0:
        return out, lse
    kernels = _kernels()
    with on_device(ops.q.device):
        _launch(kernels.forward, kernels.autotuned, "BLOCK_M", rows, heads,
                ops.q, ops.k, ops.v, ops.bound(ops.starts), out, lse, *ops.head_strides(), float(scale) * LOG2E,
                **ops.dims())
    return out, lse


def _backward(ops: _Operands, out: Tensor, lse: Tensor, grad_out: Tensor, scale: float,
              grad_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)` in `grad_dtype` from the output, its LSE (natural log) and the output gradient."""
    q, k, v = ops.q, ops.k, ops.v
    dq = torch.empty(q.shape, dtype=grad_dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=grad_dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=grad_dtype, device=q.device)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    out, grad_out = _unit_columns(out), _unit_columns(grad_out)  # the kernels round dO to q's dtype
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    kernels = _kernels()
    dims, strides, scales = ops.dims(), ops.head_strides(), (float(scale), float(scale) * LOG2E)
    with on_device(q.device):
        _launch(kernels.query_grad, kernels.autotuned, "BLOCK_M", q.shape[0], q.shape[1],
                q, k, v, ops.bound(ops.starts), out, grad_out, lse, delta, dq, *strides, *out.stride()[:2],
                *grad_out.stride()[:2], *scales, **dims)
        for key_grad, grad in ((True, dk), (False, dv)):
            _launch(kernels.key_value_grad, kernels.autotuned, "BLOCK_N", k.shape[0], k.shape[1],
                    q, k, v, ops.bound(ops.starts), ops.bound(ops.ends), grad_out, lse, delta, grad, *strides,
                    *grad_out.stride()[:2], *scales, KEY_GRAD=key_grad, **dims)
    return dq, dk, dv


class _CausalAttention(torch.autograd.Function):
    """The forward and backward kernels with autograd: saves q, k, v, the output and its LSE."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, starts: Tensor, ends: Tensor, scale: float):
        ops = _Operands(_unit_columns(q), _unit_columns(k), _unit_columns(v), starts, ends)
        out, lse = _forward(ops, scale, q.dtype)
        ctx.save_for_backward(ops.q, ops.k, ops.v, starts, ends, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_lse: Optional[Tensor]):
        q, k, v, starts, ends, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(_Operands(q, k, v, starts, ends), out, lse, grad_out, ctx.scale, q.dtype)
        return dq, dk, dv, None, None, None


# ---------------------------------------------------------------- entry points
@isolate_non_finite
def dense_attention(q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout, scale: float) -> tuple[Tensor, Tensor]:
    """The `dense_attention` contract: `out [T, H, Dv]` (q's dtype, differentiable in q, k, v) and natural-log
    `lse [T, H]` float32 (no gradient), causal within each segment of `layout`; NaN and infinity isolated per
    row as in the reference (`isolate_non_finite`)."""
    _check(q, k, v)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"dense_attention needs one key row per query row, got {q.shape[0]} and {k.shape[0]}")
    require_triton(q.device, "dense attention", "q's device")
    count_variant(BACKEND, OpFamily.DENSE_ATTENTION, VARIANT)
    starts, ends = segment_bounds(layout)
    return _CausalAttention.apply(q, k, v, starts, ends, float(scale))


def _block_operands(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> _Operands:
    _check(q, k, v)
    if causal and k.shape[0] != q.shape[0]:
        raise ValueError(f"a causal (diagonal) block needs as many key rows as query rows, got {k.shape[0]} and "
                         f"{q.shape[0]}")
    require_triton(q.device, "dense attention", "q's device")
    if not causal:
        return _Operands(_unit_columns(q), _unit_columns(k), _unit_columns(v), None, None)
    rows = q.shape[0]
    return _Operands(_unit_columns(q), _unit_columns(k), _unit_columns(v),
                     torch.zeros(rows, dtype=torch.int32, device=q.device),
                     torch.full((rows,), rows, dtype=torch.int32, device=q.device))


def block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """The `dense_attention_block_fwd` contract: `q [n, H, Dqk]` over `k [m, G, Dqk]`, `v [m, G, Dv]` (`causal`:
    the diagonal block, `n == m`) → `out [n, H, Dv]`, natural-log `lse [n, H]`, both in the compute dtype."""
    ops = _block_operands(q, k, v, causal)
    count_variant(BACKEND, OpFamily.DENSE_ATTENTION_BLOCK_FWD, VARIANT)
    out, lse = _forward(ops, scale, compute_dtype(q.dtype))
    return out, lse.to(compute_dtype(q.dtype))


def block_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The `dense_attention_block_bwd` contract: `(dq, dk, dv)` in the compute dtype of one block's share of the
    attention whose merged output is `out [n, H, Dv]` with natural-log `lse [n, H]`, given `grad_out`."""
    ops = _block_operands(q, k, v, causal)
    count_variant(BACKEND, OpFamily.DENSE_ATTENTION_BLOCK_BWD, VARIANT)
    return _backward(ops, out, lse, grad_out, scale, compute_dtype(q.dtype))
