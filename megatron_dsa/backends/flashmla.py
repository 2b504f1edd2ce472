"""The `flashmla` backend: FlashMLA's sparse prefill forward (`flash_mla.flash_mla_sparse_fwd`) and its FP8 sparse
decode (`flash_mla.flash_mla_with_kvcache` over an FP8 attention-row cache, `ops.paged_rows`).

FlashMLA is an optional dependency built from source (docs/kernels.md says how); it has no backward,
so it serves `sparse_attention_fwd` (paired with the cuDNN or reference backward) and `paged_decode_attention`.

Contract glue: q `[N, H, D]` with heads padded to 64/128 (zero queries, −inf sinks: a −inf sink has
no effect on the output; a chunk of rows at a time, `sparse_layout.padded_row_chunks`), kv `[M, 1, D]`,
ids `[N, 1, K]` int32 with K padded to a multiple of 128 (the SM90 kernel's tile) with −1. FlashMLA's
`attn_sink` scales the output by `exp(lse)/(exp(lse)+exp(sink))` and leaves the LSE sink-free, which is
our convention. Its LSE base
changed between FlashMLA versions (an older docstring says base 2; the current one returns natural
log), so the base is measured once with a one-key row and converted to natural log if needed.
Rows without a valid id come back with out 0 and lse +inf; we return lse −inf there.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from megatron_dsa.backends import probes
from megatron_dsa.backends.registry import Backend, OpFamily, dispatch, register_backend
from megatron_dsa.backends.sparse_layout import (
    HEAD_TILE,
    empty_rows,
    heads_problem,
    kernel_ids,
    kv_rows_problem,
    pad_heads,
    padded_heads,
    padded_row_chunks,
    rows_in_chunks,
)
from megatron_dsa.ops.decode_attention import check_paged_decode_inputs, entry_counts
from megatron_dsa.ops.paged_rows import PagedRows

PACKAGE = "flash_mla"
INSTALL_HINT = "build FlashMLA from source (see docs/kernels.md, 'FlashMLA')"
HEAD_DIM = 512  # d_qk = d_v = 512: our V is the whole KV row
TOPK_ALIGNMENT = 128


def _fwd() -> Any:
    return probes.load(PACKAGE).flash_mla_sparse_fwd


@functools.lru_cache(maxsize=None)
def package_problem() -> Optional[str]:
    problem = probes.import_problem(PACKAGE, INSTALL_HINT)
    if problem is None and not hasattr(probes.load(PACKAGE), "flash_mla_sparse_fwd"):
        return f"this flash_mla build has no flash_mla_sparse_fwd (sparse prefill); {INSTALL_HINT}"
    return problem


def _run(query: Tensor, kv: Tensor, ids: Tensor, sink: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    result = _fwd()(query, kv.unsqueeze(1).contiguous(), ids.unsqueeze(1), float(scale),
                    d_v=kv.shape[-1], attn_sink=sink)
    return result[0], result[2]  # (out, max_logits, lse[, lse_indexer])


@functools.lru_cache(maxsize=None)
def _lse_is_base2(device: torch.device, dtype: torch.dtype) -> bool:
    """One row, one key with logit exactly 1: a natural-log LSE is 1, a base-2 one log2(e)."""
    kv = torch.zeros(1, HEAD_DIM, dtype=dtype, device=device)
    kv[0, 0] = 1.0
    query = torch.zeros(1, HEAD_TILE, HEAD_DIM, dtype=dtype, device=device)
    query[:, :, 0] = 1.0
    ids = torch.full((1, TOPK_ALIGNMENT), -1, dtype=torch.int32, device=device)
    ids[0, 0] = 0
    sink = torch.full((HEAD_TILE,), float("-inf"), device=device)
    _, lse = _run(query, kv, ids, sink, 1.0)
    return abs(float(lse[0, 0]) - math.log2(math.e)) < abs(float(lse[0, 0]) - 1.0)


def sparse_attention_forward(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor,
                             scale: float) -> tuple[Tensor, Tensor]:
    """The `sparse_attention_fwd` contract on `flash_mla.flash_mla_sparse_fwd` (see the module doc)."""
    rows, heads, head_dim = query.shape
    width = padded_heads(heads)
    ids = kernel_ids(indices, kv.shape[0], TOPK_ALIGNMENT)
    padded_sink = pad_heads(sink.float(), width, float("-inf"))

    def run(chunk: slice) -> tuple[Tensor, Tensor]:
        out, lse = _run(pad_heads(query[chunk], width), kv, ids[chunk], padded_sink, scale)
        return out[:, :heads], lse[:, :heads].float()

    out, lse = rows_in_chunks(run, padded_row_chunks(rows, heads, head_dim), rows)
    if _lse_is_base2(query.device, query.dtype):
        lse = lse * math.log(2.0)
    # Rows without keys: FlashMLA writes out = 0 (its reference defines it so) and lse = +inf; ours is −inf.
    # The output is not passed through a mask: that was a full strided pass over [N, H, D] (0.35 ms at
    # S = 4096 on an H200), and the GPU test checks the zeros.
    lse = torch.where(empty_rows(indices, kv.shape[0]).unsqueeze(1), float("-inf"), lse)
    return out.to(query.dtype).contiguous(), lse.contiguous()


# ------------------------------------------------------------------------------ sparse decode over FP8 pages
DECODE_ROPE_DIM = 64  # FlashMLA's DeepSeek-V4 cache rows: 448 e4m3 columns in 7 tiles of 64, 64 bf16 RoPE columns
DECODE_TOPK_BLOCK = 64  # the decode kernel reads ids in blocks of 64


@functools.lru_cache(maxsize=None)
def decode_package_problem() -> Optional[str]:
    problem = probes.import_problem(PACKAGE, INSTALL_HINT)
    if problem is None and "extra_k_cache" not in inspect.signature(
            getattr(probes.load(PACKAGE), "flash_mla_with_kvcache", lambda: None)).parameters:
        return (f"this flash_mla build has no FP8 sparse decode with an extra cache (flash_mla_with_kvcache(..., "
                f"extra_k_cache=...)); {INSTALL_HINT}")
    return problem


def _cache_view(paged: PagedRows) -> Tensor:
    """FlashMLA's `[num_blocks, block_size, 1, bytes per token]` view of our pages: one block per sequence, its
    per-token bytes the row and scale bytes together (the kernel finds the scales after the block's rows)."""
    token_bytes = paged.row_bytes + paged.scale_bytes
    return paged.pages.as_strided((paged.batch, paged.slots, 1, token_bytes),
                                  (paged.pages.stride(0), token_bytes, token_bytes, 1))


@functools.lru_cache(maxsize=64)
def _block_grid(batch: int, slots: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """`(ids [B, 1, K'] int32 = b · slots + slot, −1 past the slots; slot numbers [1, 1, K'], past them a number no
    valid slot reaches)`, K' = slots rounded up to the kernel's blocks of 64 ids: made once per shape."""
    width = slots + -slots % DECODE_TOPK_BLOCK
    slot = torch.arange(width, device=device)
    ids = torch.arange(batch, device=device).view(batch, 1, 1) * slots + slot
    return (torch.where(slot < slots, ids, -1).to(torch.int32),
            torch.where(slot < slots, slot, torch.iinfo(torch.int64).max).view(1, 1, width))


def _picked_ids(entry_ids: Tensor, counts: Tensor, slots: int) -> Tensor:
    """Kind C's picks `[B, K]` (−1: none; ≥ counts[b]: not visible yet) → `[B, 1, K']` int32 block ids, −1 where
    not valid, padded with −1 to blocks of 64."""
    ids = entry_ids.long()
    base = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) * slots
    flat = torch.where((ids >= 0) & (ids < counts.unsqueeze(1)), base + ids, -1).to(torch.int32)
    missing = -ids.shape[1] % DECODE_TOPK_BLOCK
    return (torch.nn.functional.pad(flat, (0, missing), value=-1) if missing else flat).unsqueeze(1)


# One scheduling plan per call shape: FlashMLA plans its split of the work once (a kernel of ~27 µs at B = 32 on
# an H200, more than its attention) and may reuse the plan while shapes, and any `topk_length` values, stay the
# same. The calls here pass no lengths (invalid rows are −1 ids), so a plan holds for every step of a shape.
_SCHEDULES: dict[tuple, Any] = {}


def _schedule(module: Any, key: tuple) -> Any:
    schedule = _SCHEDULES.get(key)
    if schedule is None:
        schedule = _SCHEDULES[key] = module.get_mla_metadata()[0]
    return schedule


def paged_decode_attention(query: Tensor, window_rows: PagedRows, seqlens: Tensor, window: int,
                           entries: Optional[PagedRows], entry_ids: Optional[Tensor], ratio: int, sink: Tensor,
                           scale: float, inverse_rope_freq: Optional[Tensor] = None) -> Tensor:
    """The `paged_decode_attention` contract (`ops.decode_attention.paged_decode_attention`) on FlashMLA's FP8
    sparse decode: the compressed entries as its cache and the window ring as its extra cache (kind W: the ring
    alone), each sequence one block, rows that are not attended given as −1 ids (no lengths, so its scheduling
    plan is made once per shape, `_schedule`). Heads padded to 64 / 128 (zero queries; their sinks −inf); the
    output's RoPE columns turned back by the `rope` family."""
    check_paged_decode_inputs(query, window_rows, seqlens, window, entries, entry_ids, ratio, sink,
                              inverse_rope_freq)
    if window_rows.dim != HEAD_DIM or window_rows.rope != DECODE_ROPE_DIM:
        raise ValueError(f"flashmla paged decode reads rows of D = {HEAD_DIM} with P = {DECODE_ROPE_DIM} RoPE "
                         f"columns, got D = {window_rows.dim}, P = {window_rows.rope}")
    batch, heads, dim = query.shape
    width = padded_heads(heads)
    positions = seqlens.view(batch, 1, 1)
    ids, slot = _block_grid(batch, window, query.device)
    caches = [(window_rows, torch.where(slot <= positions, ids, -1))]  # the ring holds positions ≤ p: slots ≤ p
    if entries is not None:
        counts = entry_counts(seqlens, ratio)
        if entry_ids is None:  # kind H: every visible entry, the first counts[b] slots
            ids, slot = _block_grid(batch, entries.slots, query.device)
            caches.insert(0, (entries, torch.where(slot < counts.view(batch, 1, 1), ids, -1)))
        else:
            caches.insert(0, (entries, _picked_ids(entry_ids, counts, entries.slots)))
    (main, main_ids), (extra, extra_ids) = caches[0], (caches[1] if len(caches) > 1 else (None, None))
    module = probes.load(PACKAGE)
    schedule = _schedule(module, (query.device, batch, width, main.slots, main_ids.shape[-1],
                                  None if extra is None else (extra.slots, extra_ids.shape[-1])))
    out, _ = module.flash_mla_with_kvcache(
        pad_heads(query, width).unsqueeze(1), _cache_view(main), None, None, dim, schedule,
        softmax_scale=float(scale), is_fp8_kvcache=True, indices=main_ids,
        attn_sink=pad_heads(sink.float(), width, float("-inf")),
        extra_k_cache=None if extra is None else _cache_view(extra), extra_indices_in_kvcache=extra_ids)
    out = out[:, 0, :heads].to(query.dtype)
    if inverse_rope_freq is None:
        return out
    turn_back = dispatch(OpFamily.ROPE, device=out.device, dtype=out.dtype)
    return turn_back(out, seqlens, inverse_rope_freq, inverse=True)


def probe(op: OpFamily, call: Mapping[str, Any]) -> Optional[str]:
    heads, decode = call.get("heads"), op is OpFamily.PAGED_DECODE_ATTENTION
    return probes.first_problem(
        decode_package_problem() if decode else package_problem(),
        probes.gpu_problem(call, (9, 10), "FlashMLA sparse decode" if decode else "FlashMLA sparse prefill"),
        probes.dtype_problem(call, (torch.bfloat16,)),
        probes.head_dim_problem(call, HEAD_DIM),
        heads_problem(heads) if heads is not None else None,
        None if decode else kv_rows_problem(call),  # decode ids are int32 per sequence block
    )


FLASHMLA = Backend(
    name="flashmla",
    ops={OpFamily.SPARSE_ATTENTION_FWD: sparse_attention_forward,
         OpFamily.PAGED_DECODE_ATTENTION: paged_decode_attention},
    probe=probe,
    version=lambda: probes.versions_line("flash_mla"),
)

register_backend(FLASHMLA)
