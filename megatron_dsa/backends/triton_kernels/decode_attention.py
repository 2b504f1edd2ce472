"""Decode attention as Triton kernels: the `decode_attention` and `paged_decode_attention` op families (contracts
and math: `megatron_dsa.ops.decode_attention`; the second reads an FP8 attention-row cache, `ops.paged_rows`).

One new query row per sequence attends its new K = V row, its window ring and its compressed entries (the
selected ones, or every visible one) with the sink in the denominator. Nothing is gathered into a new
tensor: the kernel reads each row where the cache keeps it (`_decode_attention_kernels`).

Flash-decoding. A decode step has few query rows (B sequences × H heads) and, at long contexts, many
keys (an H layer at 128k sees 1024 entries; a dense MLA cache 128k rows): one program per (sequence, head
block) would leave most of the GPU idle. The keys are therefore cut into `splits` ranges, one program
each, chosen from the shapes alone (never from `seqlens`, so a CUDA graph captured once serves every
step): as many splits as one wave of programs takes (one program a multiprocessor: a program of 64 heads ×
512 columns holds its registers), and enough that none holds more than `MAX_KEYS_PER_SPLIT` keys; at least
one index block per split, at most `MAX_SPLITS`. A second kernel merges the splits' partial results with the
sink; with a single split the first kernel writes the output itself. Each split writes float32 partials of all
its heads' columns (64 × 576 × 4 bytes at dsv4-flash dims, a fifth of what a C sequence's 641 key rows weigh),
and its program's first index block costs a query load and the pipeline's start. On an H200 (D = 512, 128k): a
C layer's batch of 32 (641 keys each, top-512) took 40.0 µs with 3 splits, 36.4 with 4 (128 programs), 49.4
with 5 (a second wave), H's (1152 keys) 45.4, 41.7 and 51.4; a batch of 1 is fastest split into one index block
per program (C 16.5 µs with 11 splits, 28.0 with 4). Long rows need the splits for bandwidth: a dense MLA cache
of 128k rows took 235 µs at B = 1 in 66 splits, 147 in 128; at B = 32, 33 splits (4096 keys each) beat 128.

Value parts. A program of 64 heads × 512 columns keeps a float32 accumulator of 128 KiB, with its query and key
tiles more than 255 registers a thread hold (an sm_90a compile spills 420 bytes a thread). Where the splits are at
one key block each and still leave multiprocessors idle (small batches), two programs share each (sequence, head
block, split): both score with every column, each accumulates and writes half of the output's columns (no spills),
and the extra programs run on idle multiprocessors. H200, D = 512, 128k, graph replays: C at B = 1 16.7 → 13.7 µs;
at B = 32, where every multiprocessor is busy already, 36.5 → 36.1 (C) and 41.4 → 47.4 (H): one part there.

Inverse RoPE. The W, C and H layers turn their output's RoPE columns back to position 0 right after the attention
(`ops.rope`, inverse); the combine kernel does it as it writes those columns, with the RoPE kernel's roundings
(the output rounded to its dtype first, then `rotate_pairs`), so a step launches one kernel fewer and gets the same
bits.

Float32 partials are allocated per call with sizes fixed by the shapes, so a captured step replays with
them in the graph's pool. Everything else is read where it lies; `seqlens` is read on the device.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import interpreting, require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.rope import rope
from megatron_dsa.backends.triton_kernels.tiles import (MIN_DOT, cdiv, dot_precision, head_dim_chunks, on_device, pow2,
                                                       programs_in_wave)
from megatron_dsa.ops.decode_attention import check_decode_inputs, check_paged_decode_inputs
from megatron_dsa.ops.paged_rows import PagedRows, tile_width

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = math.log2(math.e)
MAX_BLOCK_H = 64  # heads per program: one Hopper warpgroup MMA tile, as the training forward
MAX_SPLITS = 128  # the combine kernel holds every split of a head in registers
MAX_KEYS_PER_SPLIT = 4096
INTERPRETER_BLOCK_K = 16
COMBINE_ELEMENTS = 4096  # split × column elements the combine kernel holds per chunk
# Key rows a program decodes from FP8 pages per step: its codes, scale bytes and RoPE bytes become the key tile in
# registers, and an sm_90a compile of dsv4's tiles (64 heads × 512 columns, 8 warps) spills thousands of bytes a
# thread at 64 rows, about a thousand at 32, a hundred or two at 16. H200, B = 32, 128k, graph: C 289 µs on FP8
# pages against 293 on bf16 rows, H 197 against 157 (docs/performance.md, "FP8 attention rows").
PAGED_BLOCK_K = 16



class DecodeTiles(NamedTuple):
    """A launch's tiles: key rows per step, warps per program, pipeline stages and value parts (programs that
    share a (sequence, head block, split), each accumulating a part of the output's columns)."""

    block_k: int
    warps: int
    stages: int
    parts: int = 1


def decode_tiles(dtype: torch.dtype, heads: int, dim: int, paged: bool = False) -> DecodeTiles:
    """The tiles for `heads` query rows of `dim` columns in `dtype`: 64 key rows per step for 16-bit rows up to
    D = 512 (as the training forward), else 32 (shared memory); `PAGED_BLOCK_K` rows of FP8 pages (their tiles are
    decoded in registers); 8 warps where a program's query tile spans 64 heads × 256 columns or more."""
    if interpreting():
        return DecodeTiles(INTERPRETER_BLOCK_K, 4, 2)
    wide = pow2(heads, MIN_DOT, MAX_BLOCK_H) * head_dim_chunks(dim)[0] >= MAX_BLOCK_H * 256
    block_k = PAGED_BLOCK_K if paged else (64 if dtype.itemsize == 2 and dim <= 512 else 32)
    return DecodeTiles(block_k, 8 if wide else 4, 2)


def value_parts(batch: int, heads: int, slots: int, dim: int, block_k: int, device: torch.device) -> int:
    """2 where even one key block per split leaves multiprocessors idle and the head dim is one power of two (module
    docstring), else 1."""
    blocks = batch * cdiv(heads, MAX_BLOCK_H) * cdiv(slots, block_k)
    return 2 if head_dim_chunks(dim)[1] == 0 and dim >= 2 * MIN_DOT and 2 * blocks <= programs_in_wave(device) else 1


def default_tiles(dtype: torch.dtype, batch: int, heads: int, slots: int, dim: int, device: torch.device,
                  paged: bool = False) -> DecodeTiles:
    """A launch's tiles when none are given: `decode_tiles`, with two value parts where `value_parts` takes them."""
    tiles = decode_tiles(dtype, heads, dim, paged)
    return tiles._replace(parts=value_parts(batch, heads, slots, dim, tiles.block_k, device))


def split_count(batch: int, heads: int, slots: int, block_k: int, device: torch.device, parts: int = 1) -> int:
    """Key ranges per (sequence, head block), from the shapes alone (module docstring)."""
    programs = batch * cdiv(heads, MAX_BLOCK_H) * parts
    wanted = max(programs_in_wave(device) // programs, cdiv(slots, MAX_KEYS_PER_SPLIT))
    return max(1, min(wanted, cdiv(slots, block_k), MAX_SPLITS))


class _KeyRows(NamedTuple):
    """Where a launch reads each sequence's key rows: its new row (`new [B, D]`, or None where the ring holds it), the
    ring (`R` slots, `limit` of them valid at most), the entries (`C` slots, or None), and for FP8 pages their
    format (`ops.paged_rows.PagedRows`, whose `pages` are `ring` / `entries`)."""

    new: Optional[Tensor]
    ring: Tensor
    ring_slots: int
    limit: int
    entries: Optional[Tensor]
    entry_slots: int
    pages: Optional[PagedRows] = None


def decode_attention(query: Tensor, kv_new: Tensor, window_rows: Tensor, seqlens: Tensor, window: int,
                     entries: Optional[Tensor], entry_ids: Optional[Tensor], ratio: int, sink: Tensor,
                     scale: float, inverse_rope_freq: Optional[Tensor] = None, splits: Optional[int] = None,
                     tiles: Optional[DecodeTiles] = None) -> Tensor:
    """The `decode_attention` contract (`ops.decode_attention.decode_attention`) → `out [B, H, D]` in the query
    dtype. `splits` overrides the key ranges per (sequence, head block) (default: `split_count`), `tiles` the
    launch's tiles (default: `decode_tiles`); both for tests and benchmarks. The inverse RoPE is the combine's
    last step (module docstring); a launch of a single split leaves it to the RoPE kernel."""
    check_decode_inputs(query, kv_new, window_rows, seqlens, window, entries, entry_ids, ratio, sink,
                        inverse_rope_freq)
    if window_rows.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"triton decode attention runs {[str(d) for d in SUPPORTED_DTYPES]}, got query "
                        f"{query.dtype} and cache {window_rows.dtype}")
    rows = _KeyRows(kv_new.contiguous(), window_rows.contiguous(), window_rows.shape[1], max(window - 1, 0),
                    None if entries is None else entries.contiguous(), 0 if entries is None else entries.shape[1])
    return _attend(query, rows, seqlens, entry_ids, ratio, sink, scale, inverse_rope_freq, splits, tiles)


def paged_decode_attention(query: Tensor, window_rows: PagedRows, seqlens: Tensor, window: int,
                           entries: Optional[PagedRows], entry_ids: Optional[Tensor], ratio: int, sink: Tensor,
                           scale: float, inverse_rope_freq: Optional[Tensor] = None, splits: Optional[int] = None,
                           tiles: Optional[DecodeTiles] = None) -> Tensor:
    """The `paged_decode_attention` contract (`ops.decode_attention.paged_decode_attention`): the same kernels
    reading FP8 pages (codes, their tiles' scales and the RoPE bytes of each row, where `decode_attention` reads
    its rows' elements); `splits` and `tiles` as there."""
    check_paged_decode_inputs(query, window_rows, seqlens, window, entries, entry_ids, ratio, sink,
                              inverse_rope_freq)
    rows = _KeyRows(None, window_rows.pages, window_rows.slots, window,
                    None if entries is None else entries.pages, 0 if entries is None else entries.slots, window_rows)
    return _attend(query, rows, seqlens, entry_ids, ratio, sink, scale, inverse_rope_freq, splits, tiles)


def _attend(query: Tensor, rows: _KeyRows, seqlens: Tensor, entry_ids: Optional[Tensor], ratio: int, sink: Tensor,
            scale: float, inverse_rope_freq: Optional[Tensor], splits: Optional[int],
            tiles: Optional[DecodeTiles]) -> Tensor:
    """Both contracts' launch: the split kernel over `rows`, then the combine (module docstring)."""
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"triton decode attention runs {[str(d) for d in SUPPORTED_DTYPES]}, got query {query.dtype}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"triton decode attention: scale must be a finite number, got {scale!r}")
    require_triton(query.device, "decode attention", "query's device")
    batch, heads, dim = query.shape
    out = torch.empty((batch, heads, dim), dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    selected = entry_ids is not None
    has_entries = rows.entries is not None
    entry_slots = 0 if not has_entries else (entry_ids.shape[1] if selected else rows.entry_slots)
    slots = (rows.new is not None) + rows.ring_slots + entry_slots
    if tiles is None:
        tiles = default_tiles(query.dtype, batch, heads, slots, dim, query.device, paged=rows.pages is not None)
    block_k, warps, stages, parts = tiles
    splits = split_count(batch, heads, slots, block_k, query.device, parts) if splits is None else splits
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"triton decode attention: splits must be in [1, {MAX_SPLITS}], got {splits}")
    per_split = cdiv(cdiv(slots, splits), block_k) * block_k
    splits = cdiv(slots, per_split)  # no empty split
    block_h = pow2(heads, MIN_DOT, MAX_BLOCK_H)
    block_d, block_dt = head_dim_chunks(dim)
    if parts not in (1, 2) or (parts == 2 and (block_dt > 0 or block_d < 2 * MIN_DOT)):
        raise ValueError(f"triton decode attention: value parts must be 1, or 2 where the head dim is a power of two "
                         f"of at least {2 * MIN_DOT}; got {parts} at head dim {dim}")
    partials = (heads * batch * splits * dim, heads * batch * splits) if splits > 1 else (1, 1)
    part_acc = torch.empty(partials[0], dtype=torch.float32, device=query.device)
    part_max = torch.empty(partials[1], dtype=torch.float32, device=query.device)
    part_sum = torch.empty(partials[1], dtype=torch.float32, device=query.device)
    sink = sink.detach().to(torch.float32).contiguous()
    query = query.contiguous()
    pages = rows.pages
    page_format = dict(PAGED=pages is not None, NOPE=0, TILE=1, ROW_BYTES=0, SCALE_BYTES=0)
    if pages is not None:
        page_format.update(NOPE=pages.nope, TILE=tile_width(pages.nope), ROW_BYTES=pages.row_bytes,
                           SCALE_BYTES=pages.scale_bytes)
    page_strides = [rows.ring.stride(0) if pages is not None else 0,
                    rows.entries.stride(0) if pages is not None and has_entries else 0]
    with on_device(query.device):
        launcher(_kernels().decode_attention_split_kernel)[(batch * cdiv(heads, block_h) * parts, splits)](
            query, query if rows.new is None else rows.new, rows.ring,
            query if rows.entries is None else rows.entries,
            seqlens if entry_ids is None else entry_ids.contiguous(), seqlens.contiguous(), sink,
            out, part_acc, part_max, part_sum, float(scale) * LOG2E,
            heads, dim, rows.ring_slots, rows.limit, rows.entry_slots, max(entry_slots, 1),
            ratio if has_entries else 1, slots, per_split, *page_strides,
            SPLITS=splits, HAS_ENTRIES=has_entries, SELECTED=selected,
            BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_D=block_d, BLOCK_DT=block_dt, VALUE_PARTS=parts, **page_format,
            DOT_PRECISION=dot_precision(query.dtype), num_warps=warps, num_stages=stages,
            **chained_launch(query.device))
        if splits > 1:
            block_s = pow2(splits)
            half = 0 if inverse_rope_freq is None else inverse_rope_freq.shape[0]
            freq = sink if inverse_rope_freq is None else inverse_rope_freq.to(query.device, torch.float32).contiguous()
            launcher(_kernels().decode_combine_kernel)[(batch * heads,)](
                part_acc, part_max, part_sum, sink, out, seqlens.contiguous(), freq, heads, dim, SPLITS=splits,
                BLOCK_S=block_s, BLOCK_D=pow2(dim, 1, max(MIN_DOT, COMBINE_ELEMENTS // block_s)), HALF=half,
                BLOCK_HALF=pow2(max(half, 1)), num_warps=4, **chained_launch(query.device))
        elif inverse_rope_freq is not None:
            out = rope(out, seqlens, inverse_rope_freq, inverse=True)
    return out


def _kernels():
    from megatron_dsa.backends.triton_kernels import _decode_attention_kernels

    return _decode_attention_kernels

