"""The compressor's gated pooling as a Triton kernel: a drop-in for `megatron_dsa.ops.compressor.gated_pool`,
and `compress`, the whole compressor with that pooling and the fused Triton RMSNorm + RoPE (projections
and Hadamard stay the ops').

Entry `e` pools the token rows of its own group (`own[e] … own[e] + r − 1`) and, for the overlapping
ratio-4 compressor (`coff = 2`), those of the previous group (`prev[e] = own[e] − r`) through the first
`Dc` channels while its own group goes through the last `Dc`. Unused capacity rows (`own = −1`) come
out as zeros and take no gradient; the first entry of a sequence (`prev = −1`) has no previous
group (value 0, logit −inf). The softmax over the slots and the weighted sum run in float32
(float64 for float64 kv) and are rounded once to kv's dtype, like the reference.

Backward: the kernel recomputes the softmax from the saved inputs and writes dkv and dgate per token
row. Each (token row, channel) feeds at most one entry: its own group's entry through the last `Dc`
channels and the next group's entry through the first `Dc` (ratio ≥ 8: its group's entry through
all channels), so every element is written at most once, by the program of that entry and channel
block, with plain stores (deterministic, no atomics); elements no entry reads (tails, padding, the
first `Dc` channels of a sequence's last group) stay zero.
dape is reduced in two stages: each entry block stores its sum over its entries, then the blocks are
summed (deterministic as well).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import launcher
from megatron_dsa.backends.triton_kernels.norm_rope import norm_rope
from megatron_dsa.backends.triton_kernels.tiles import cdiv, fresh_rows, kernel_rows, multiprocessors, pow2
from megatron_dsa.ops.compressor import channel_factor
from megatron_dsa.ops.compressor import compress as reference_compress
from megatron_dsa.ops.layout import CompressedLayout
from megatron_dsa.ops.precision import compute_dtype

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Token rows per tile (BLOCK_E entries × BLOCK_S slots) and channels per program. Compiled for sm_90 at
# Dc = 512, [64 rows, 64 channels] tiles with 8 warps need ≤ 147 registers per thread and spill nothing
# (4 warps spilled in the ratio-4 backward). A ratio up to SLOTS_PER_TILE is one sweep step; ratio 128
# takes 4 steps over 2 entries per program.
TILE_ROWS = 64
SLOTS_PER_TILE = 32
BLOCK_CHANNELS = 64
NUM_WARPS = 8  # for a full tile: smaller tiles take a warp per ROWS_PER_WARP·BLOCK_C elements
ROWS_PER_WARP = 8
# Few entries (a decode step pools one per sequence; ratio 128 at a few thousand tokens) would leave most
# multiprocessors idle: entry blocks halve, down to one entry, until the grid has this many programs per SM.
FILL_PROGRAMS_PER_SM = 2


def _tiles(ratio: int, dc: int, entries: int, device: torch.device) -> dict:
    slots = min(pow2(ratio), SLOTS_PER_TILE)
    block_e, block_c = max(1, TILE_ROWS // slots), min(BLOCK_CHANNELS, pow2(dc))
    while block_e > 1 and cdiv(entries, block_e) * cdiv(dc, block_c) < _fill_programs(device):
        block_e //= 2
    return dict(BLOCK_E=block_e, BLOCK_S=slots, BLOCK_C=block_c)


def _fill_programs(device: torch.device) -> int:
    """Programs a grid should reach before its tiles stop shrinking (the interpreter keeps full tiles)."""
    return FILL_PROGRAMS_PER_SM * multiprocessors(device) if device.type == "cuda" else 1


def _warps(tiles: dict) -> int:
    return max(1, min(NUM_WARPS, tiles["BLOCK_E"] * tiles["BLOCK_S"] // ROWS_PER_WARP))


def _run(kv: Tensor, gate: Tensor, ape: Tensor, own: Tensor, previous: Tensor, ratio: int, **buffers) -> None:
    """Launch the kernel: forward with `out_ptr`, backward with `grad_ptr, dkv_ptr, dgate_ptr, dape_ptr`
    (the pointers of the other pass are None)."""
    from megatron_dsa.backends.triton_kernels import _compressor_kernels as kernels
    import triton.language as tl

    coff = channel_factor(ratio)
    entries, dc = own.shape[0], kv.shape[1] // coff
    if entries == 0 or dc == 0:
        return
    tiles = _tiles(ratio, dc, entries, kv.device)
    grid = (cdiv(entries, tiles["BLOCK_E"]), cdiv(dc, tiles["BLOCK_C"]))
    launcher(kernels.gated_pool_kernel)[grid](
        kv_ptr=kv, gate_ptr=gate, ape_ptr=ape, own_ptr=own, prev_ptr=previous, E=entries, DC=dc,
        KV_STRIDE=kv.stride(0), GATE_STRIDE=gate.stride(0), RATIO=ratio,
        COFF=coff, BACKWARD=buffers["out_ptr"] is None,
        COMPUTE=tl.float64 if kv.dtype == torch.float64 else tl.float32, num_warps=_warps(tiles), **tiles, **buffers)


def _forward(kv: Tensor, gate: Tensor, ape: Tensor, own: Tensor, previous: Tensor, ratio: int) -> Tensor:
    """kv, gate `[T, coff·Dc]` (`tiles.kernel_rows`), ape `[r, coff·Dc]` and own / previous `[E]` int64
    contiguous → `[E, Dc]`."""
    out = torch.empty((own.shape[0], kv.shape[1] // channel_factor(ratio)), dtype=kv.dtype, device=kv.device)
    _run(kv, gate, ape, own, previous, ratio, out_ptr=out, grad_ptr=None, dkv_ptr=None, dgate_ptr=None,
         dape_ptr=None)
    return out


def _backward(kv: Tensor, gate: Tensor, ape: Tensor, own: Tensor, previous: Tensor, ratio: int,
              grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`(dkv, dgate, dape)` for the contiguous upstream `grad [E, Dc]` (other arguments as `_forward`)."""
    compute = compute_dtype(kv.dtype)
    entries = own.shape[0]
    blocks = cdiv(entries, _tiles(ratio, kv.shape[1] // channel_factor(ratio), entries, kv.device)["BLOCK_E"])
    # Contiguous (kv and gate may be strided rows); rows no entry reads stay 0.
    grad_kv, grad_gate = (fresh_rows(kv).zero_() for _ in range(2))
    partial = torch.empty((blocks, ratio, kv.shape[1]), dtype=compute, device=kv.device)  # every block writes all
    _run(kv, gate, ape, own, previous, ratio, out_ptr=None, grad_ptr=grad, dkv_ptr=grad_kv, dgate_ptr=grad_gate,
         dape_ptr=partial)
    return grad_kv, grad_gate, partial.sum(0).to(ape.dtype)


class TritonGatedPool(torch.autograd.Function):
    """`(kv, gate [T, coff·Dc], ape [r, coff·Dc], own, previous [E], ratio) → [E, Dc]` in kv's dtype.

    kv and gate arrive as `tiles.kernel_rows` (a column slice of wider rows is read in place), the others
    contiguous; only the inputs are saved for backward."""

    @staticmethod
    def forward(ctx, kv: Tensor, gate: Tensor, ape: Tensor, own: Tensor, previous: Tensor, ratio: int) -> Tensor:
        ctx.save_for_backward(kv, gate, ape, own, previous)
        ctx.ratio = ratio
        return _forward(kv, gate, ape, own, previous, ratio)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        kv, gate, ape, own, previous = ctx.saved_tensors
        grad_kv, grad_gate, grad_ape = _backward(kv, gate, ape, own, previous, ctx.ratio, grad_out.contiguous())
        return grad_kv, grad_gate, grad_ape, None, None, None


def gated_pool(kv: Tensor, gate: Tensor, ape: Tensor, layout: CompressedLayout) -> Tensor:
    """Pool token projections into compressed entries (same contract as `ops.compressor.gated_pool`).

    kv, gate: `[T, coff·Dc]` token projections, one dtype among `SUPPORTED_DTYPES`.
    ape:      `[r, coff·Dc]` learned bias of the gate logits at each in-group slot (any supported dtype).
    Returns   `[capacity, Dc]` in kv's dtype; unused capacity rows are 0 and take no gradient.
    Gradients flow to kv, gate and ape.
    """
    _check_inputs(kv, gate, ape, layout)
    # The reference reads the previous group at `own − r` (clamped at row 0); layouts keep that row in
    # the same segment (a context-parallel piece carries the preceding rows as its halo).
    own, previous = layout.pooled_group_starts
    return TritonGatedPool.apply(kernel_rows(kv), kernel_rows(gate), ape.contiguous(), own, previous, layout.ratio)


def compress(kv: Tensor, gate: Tensor, ape: Tensor, norm_weight: Tensor, eps: float, layout: CompressedLayout,
             inv_freq: Tensor, rotate: bool) -> Tensor:
    """`ops.compressor.compress` with the Triton pooling and the fused RMSNorm + RoPE (shapes there)."""
    return reference_compress(kv, gate, ape, norm_weight, eps, layout, inv_freq, rotate, pool=gated_pool,
                              normalise_and_rotate=norm_rope)


def _check_inputs(kv: Tensor, gate: Tensor, ape: Tensor, layout: CompressedLayout) -> None:
    if not isinstance(layout, CompressedLayout):
        raise TypeError(f"gated_pool layout must be a CompressedLayout, got {type(layout).__name__}")
    r, coff = layout.ratio, channel_factor(layout.ratio)
    if kv.dim() != 2 or kv.shape != gate.shape or kv.shape[1] % coff or ape.shape != (r, kv.shape[1]):
        raise ValueError(f"compressor shapes disagree: kv {tuple(kv.shape)}, gate {tuple(gate.shape)}, "
                         f"ape {tuple(ape.shape)} for ratio {r} (expected kv and gate [T, {coff}·Dc], "
                         f"ape [{r}, {coff}·Dc])")
    if kv.shape[0] != layout.tokens.num_rows:
        raise ValueError(f"gated_pool kv has {kv.shape[0]} rows but the layout has {layout.tokens.num_rows}")
    if kv.dtype not in SUPPORTED_DTYPES or gate.dtype != kv.dtype or ape.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"triton gated_pool needs kv and gate of one dtype among {SUPPORTED_DTYPES} and ape "
                        f"of one of them, got kv {kv.dtype}, gate {gate.dtype}, ape {ape.dtype}")
    devices = {kv.device, gate.device, ape.device, layout.tokens.device}
    if len(devices) != 1:
        raise ValueError(f"gated_pool kv, gate, ape and layout must share one device, got {sorted(map(str, devices))}")
    require_triton(kv.device, "gated_pool", "kv's device")
