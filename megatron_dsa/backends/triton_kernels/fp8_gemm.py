"""The `fp8_gemm` family for a few rows as Triton kernels: a decode step's projections (contract and math:
`megatron_dsa.ops.fp8_linear`; kernels: `_fp8_gemm_kernels.py`; measurements: docs/performance.md, "A few-rows
FP8 GEMM for decode steps").

A decode step multiplies a few token rows (the batch) by every projection weight, so its GEMMs are bound by
reading the weights: the e4m3 codes the inference cache keeps (`RoundedWeights`) are half of bf16's bytes.
cuBLASLt's rowwise-scaled FP8 GEMM (`torch_scaled_mm`) takes about 13 µs at K = 4096 whatever N on an H200,
slower than bf16 for all but the widest weight. Here one launch rounds a's rows (`fp8_quantize.quantize_each_row`)
and one multiplies:

* b's rows on the MMA's M side, `BLOCK_N = 64` output features per program, a's rows (up to 64 per program) on
  its N side: no padded rows of a worth mentioning, which a 64-row M side would need.
* a grouped projection's kept codes `[G, N, K]` in the same launch (the grid runs over groups and their blocks).
* an output of few tiles (`linear_proj`'s 4096 features over K = 8192) would leave most multiprocessors idle,
  so the K range is split until the grid has about `PROGRAMS_PER_SM` programs per multiprocessor (splits of at
  least `MIN_STEPS_PER_SPLIT` K steps); the last split of a tile to finish adds the float32 partials in split
  order (deterministic), so there is no third launch. Its tickets, one int32 per output tile, live per (device,
  stream) and are back at zero after every call, so a captured CUDA graph replays with them.
* every MMA's 32 products move into a float32 sum (`PRECISE_EVERY`): chained, Hopper's e4m3 MMAs keep about
  14 bits.

For more rows than `MAX_AUTO_ROWS` `auto` takes cuBLASLt (`backends.triton`'s probe); named, the kernels run any
shape (the tests' training steps: a tiny batch's backward GEMMs).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import interpreting, require_triton
from megatron_dsa.backends.triton_kernels.fp8_quantize import quantize_each_row
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.tiles import cdiv, on_device, pow2, programs_in_wave, zeros_per_stream
from megatron_dsa.ops.fp8_linear import FP8

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_AUTO_ROWS = 64  # a's rows up to which `auto` takes these kernels (one block of a's rows per program)
BLOCK_N = 64  # b's rows per program: one warpgroup MMA's M side
MIN_BLOCK_M = 16  # the MMA's narrowest N side in Triton
BLOCK_K = 128  # e4m3 codes per row and step: 8 KiB of b per stage
# Every MMA's 32 products join the float32 sum (the kernel's `PRECISE_EVERY`), as cuBLASLt without fast
# accumulation: the GEMM is bound by the weights' bytes, the adds cost nothing measurable.
PRECISE_EVERY = 32
INTERPRETER_BLOCK_K = 32  # an e4m3 MMA's shortest contraction; several steps on the tests' small K
STAGES = 4
WARPS = 8  # H200, 32 × 1024 × 4096, 4 splits: 9.2 µs with 8 warps, 10.1 with 4 (3–6 stages, 256-code steps alike)
# K splits until the grid has about two programs per multiprocessor, each split at least 8 steps long (H200, 32
# rows: 4096 × 8192 14.9 µs at 4 splits, 18.5 at 2, 23.4 at 1; 8192 × 1024 6.1 µs unsplit, 7.9 at 2).
PROGRAMS_PER_SM = 2
MIN_STEPS_PER_SPLIT = 8
MAX_SPLITS = 16
MAX_SPLIT_TILES = 4096  # output tiles a split GEMM may have: its tickets (a split grid has fewer than the target)


def split_count(tiles: int, steps: int, device: torch.device) -> int:
    """K splits per output tile, from the shapes alone (module docstring)."""
    return max(1, min(round(programs_in_wave(device, PROGRAMS_PER_SM) / tiles), steps // MIN_STEPS_PER_SPLIT,
                      MAX_SPLITS))


def fp8_gemm(a: Tensor, b: Tensor, out_dtype: torch.dtype, b_scales: Optional[Tensor] = None,
             splits: Optional[int] = None) -> Tensor:
    """The `fp8_gemm` contract (`ops.fp8_linear.Fp8Gemm`): `a [M, K]·b [N, K]ᵀ` → `[M, N]` in `out_dtype`, every
    row rounded to e4m3 with its own scale (b's already where `b_scales [N, 1]` comes with its codes); grouped
    kept codes `b [G, N, K]` with a `[M, G·K]` → `[M, G·N]`, all groups in one launch. `splits` overrides the K
    splits (tests and benchmarks; default `split_count`)."""
    _check(a, b, b_scales, out_dtype)
    require_triton(a.device, "fp8 gemm", "a's device")
    groups, outputs, width = b.shape if b.dim() == 3 else (1, *b.shape)
    rows = a.shape[0]
    out = torch.empty((rows, groups * outputs), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    if width == 0:
        return out.zero_()
    with on_device(a.device):
        codes_a, scales_a = quantize_each_row(a.reshape(rows * groups, width))  # a group's columns: a row of its own
        if b_scales is None:
            codes_b, scales_b = quantize_each_row(b)
        else:
            codes_b, scales_b = b.contiguous(), b_scales.reshape(-1).to(torch.float32).contiguous()
        block_m = pow2(min(rows, MAX_AUTO_ROWS), MIN_BLOCK_M)
        block_k = INTERPRETER_BLOCK_K if interpreting() else BLOCK_K
        grid_n, grid_m = groups * cdiv(outputs, BLOCK_N), cdiv(rows, block_m)
        steps = cdiv(width, block_k)
        splits = split_count(grid_n * grid_m, steps, a.device) if splits is None else splits
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"triton fp8 gemm: splits must be in [1, {MAX_SPLITS}], got {splits}")
        per_split = cdiv(steps, splits) * block_k
        splits = cdiv(width, per_split)  # no empty split
        partials = torch.empty((splits if splits > 1 else 0, rows, groups * outputs), dtype=torch.float32,
                               device=a.device)
        tickets = _tickets(a.device, grid_n * grid_m) if splits > 1 else scales_a
        launcher(_kernels().few_rows_gemm_kernel)[(grid_n, grid_m, splits)](
            codes_a, scales_a, codes_b, scales_b, out, partials, tickets, rows, outputs, width, groups, per_split,
            SPLITS=splits, EVEN_K=width % block_k == 0, BLOCK_N=BLOCK_N, BLOCK_M=block_m, BLOCK_K=block_k,
            PRECISE_EVERY=PRECISE_EVERY, num_warps=WARPS, num_stages=STAGES, **chained_launch(a.device))
    return out


def _check(a: Tensor, b: Tensor, b_scales: Optional[Tensor], out_dtype: torch.dtype) -> None:
    groups = b.shape[0] if b.dim() == 3 else 1
    if a.dim() != 2 or b.dim() not in (2, 3) or a.shape[1] != groups * b.shape[-1]:
        raise ValueError(f"triton fp8 gemm: a [M, K] and b [N, K] must share K (grouped: a [M, G·K], b [G, N, K]), "
                         f"got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.dtype not in DTYPES or out_dtype not in DTYPES:
        raise TypeError(f"triton fp8 gemm runs a and outputs of {[str(d) for d in DTYPES]}, got a {a.dtype} and "
                        f"out_dtype {out_dtype}")
    if b_scales is None and (b.dtype not in DTYPES or b.dim() == 3):
        raise TypeError(f"triton fp8 gemm: b must be a 2-D tensor of {[str(d) for d in DTYPES]} (or e4m3 codes with "
                        f"b_scales), got {b.dim()}-D {b.dtype}")
    if b_scales is not None and (b.dtype != FP8 or b_scales.numel() != b.shape[:-1].numel()):
        raise ValueError(f"triton fp8 gemm: with b_scales, b must be e4m3 codes [(G,) N, K] and b_scales hold one "
                         f"scale per row, got b {b.dtype} {tuple(b.shape)} and b_scales {tuple(b_scales.shape)}")
    if b.device != a.device or (b_scales is not None and b_scales.device != a.device):
        raise ValueError(f"triton fp8 gemm: a, b and b_scales must share a device, got {a.device} and {b.device}")


def _tickets(device: torch.device, tiles: int) -> Tensor:
    """The zeroed int32 tickets of `tiles` output tiles for kernels on the current stream of `device`: one buffer
    per stream, never replaced (a captured graph keeps its address)."""
    if tiles > MAX_SPLIT_TILES:
        raise ValueError(f"triton fp8 gemm: a K split serves at most {MAX_SPLIT_TILES} output tiles, this GEMM has "
                         f"{tiles}; pass splits=1")
    return zeros_per_stream("fp8_gemm_tickets", (MAX_SPLIT_TILES,), device)


def _kernels():
    from megatron_dsa.backends.triton_kernels import _fp8_gemm_kernels

    return _fp8_gemm_kernels
