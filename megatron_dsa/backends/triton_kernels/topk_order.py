"""The `ops.indices.topk_columns` order as Triton kernels: valid columns by score (highest first), ties
to the lower column, −1 after them. Each program sorts one row's int64 keys in registers.

Two entry points share the sort kernel: `topk` ranks every column of a row (the `topk` op family: one
launch, where the cuDNN top-k costs a frontend call plus this kernel), and `order_picks` puts the picks
of a kernel that promises no order (cuDNN's top-k) in that order. The torch equivalent of the latter
(`backends.cudnn` uses it where Triton cannot run) takes about twenty small ops and a full radix sort.

Both sort at most `MAX_WIDTH` keys per row. A bitonic sort's work grows as n·log²n per row, and past one
warp its exchanges go through shared memory (an sm_90 compile shows no spills at the warp counts
used): on an H100 the top-k of 4096 x 1024 took 0.114 ms (cuDNN's 0.123 ms, torch's sort 0.202), of
16384 x 4096 7.3 ms (cuDNN's 0.58, torch's 2.4). So `topk` sorts whole rows up to `AUTO_MAX_COLUMNS`
(S = 4096 at ratio 4). Wider rows are first cut down to their k best columns without a sort
(`select_top_columns`: a radix select of the k-th best score, six passes over the row), whose k picks
`order_picks` then sorts: any width, k up to `MAX_WIDTH`. That is the decode step's case (one row per sequence of
up to 32768 columns at 128k tokens, top-512), where the unfused top-k ran four full radix sorts. The select
gave each row one program at first (183 µs at 32 rows of 32768 columns on an H200, against the unfused stable
sort's 84 µs); it now splits each row into chunks, one program each, about four programs per multiprocessor over
the rows, the programs of a row meeting through a histogram and a ticket in memory (`_topk_order_kernels`): top-512
of 32768 columns in 55 µs at 32 rows and 31 µs at one (H200, graph replays, `benchmarks/decode_topk.py`), against
the unfused sort's 167 / 67 µs. cuDNN's top-k is faster there still (23 µs at 32 rows in a decode step's trace), so
`auto` takes the wide-row path for at most `SELECT_AUTO_MAX_ROWS` rows where cuDNN's top-k is not installed, and
leaves the training selection's wide rows (thousands, rows unknown to the call) to cuDNN or the unfused sort.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import interpreting, require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launch, launcher
from megatron_dsa.backends.triton_kernels.tiles import cdiv, on_device, pow2, programs_in_wave, zeros_per_stream
from megatron_dsa.ops.indices import UniformVisibleRows, prefix_valid

MAX_WIDTH = 4096  # keys per row one program sorts in registers
AUTO_MAX_COLUMNS = 1024  # the widest rows sorted whole; wider ones are selected first (see above)
SELECT_BLOCK = 2048  # columns per step of the select's passes
SELECT_WARPS = 8
PROGRAMS_PER_SM = 4  # the select's programs per multiprocessor, over all rows (2: 58 µs where 4 took 55)
SELECT_MAX_ROWS = 1024  # rows of select state kept per stream (more rows: launched 1024 at a time)
# The most rows `auto` gives the wide-row path (a decode batch: one launch of the select's state). Named, `triton`
# takes it for any rows.
SELECT_AUTO_MAX_ROWS = SELECT_MAX_ROWS
SELECT_RADIX_BITS = 8  # the select's digit (the kernels read it from here): 4 passes over a 32-bit key
RADIX = 1 << SELECT_RADIX_BITS
SELECT_PASSES = 32 // SELECT_RADIX_BITS
INTERPRETER_SELECT_BLOCK = 16  # several steps per row on the tests' small rows
SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # exact in float32, where the keys are made


def topk(scores: Tensor, valid: Optional[Tensor], k: int, visible: Optional[UniformVisibleRows] = None,
         counts: Optional[Tensor] = None, ordered: bool = True) -> Tensor:
    """The `ops.indices.topk_columns` contract: scores `[T, C]` (float32/16-bit), valid `[T, C]` bool →
    `[T, min(k, C)]` int64 columns, highest score first, ties to the lower column, −1 where fewer than
    k are valid. Rows of up to `AUTO_MAX_COLUMNS` are sorted whole, wider ones selected then sorted
    (module docstring), or with `ordered=False` selected only (in column order). `visible` and `counts` (the
    family's prefix hints) add nothing `valid` does not say; without `valid`, `counts` stands for it (the select
    reads the counts; the sort builds the mask, `prefix_valid`)."""
    _check_topk(scores, valid, counts, k)
    rows, cols = scores.shape
    width = min(k, cols)
    if cols > AUTO_MAX_COLUMNS:
        ranked = scores.float().contiguous()
        picks = select_top_columns(ranked, valid, width, counts)
        return order_picks(picks, ranked, prefix_valid(valid, counts, cols)) if ordered else picks
    valid = prefix_valid(valid, counts, cols)
    from megatron_dsa.backends.triton_kernels import _topk_order_kernels as kernels

    out = torch.empty((rows, width), dtype=torch.long, device=scores.device)
    if out.numel() == 0:
        return out
    launcher(kernels.rank_columns_kernel)[(rows,)](
        None, scores.contiguous(), valid.contiguous(), out, cols, cols, cols, width, BLOCK_K=pow2(cols),
        EVERY_COLUMN=True, num_warps=_warps(cols))
    return out


def select_top_columns(scores: Tensor, valid: Optional[Tensor], k: int, counts: Optional[Tensor] = None,
                       programs_per_row: Optional[int] = None) -> Tensor:
    """The columns of each row's `k` best valid columns (the set `topk` returns) in column order, −1 after them
    where fewer are valid: scores `[T, C]` float32/16-bit, valid `[T, C]` bool, or None with `counts [T]` (the
    valid columns of row t are `[0, counts[t])`) → `[T, k]` int64, k <= C.

    Radix select, no sort (`_topk_order_kernels`): each row is split into chunks of columns, one program each
    (`programs_per_row`, by default about `PROGRAMS_PER_SM` programs per multiprocessor), which count digits for the
    row's four passes, then their columns above the threshold and tied with it, then write their picks; six
    launches, each row's histogram and ticket (`_select_workspace`) left zeroed for the next call (CUDA-graph
    safe)."""
    _check_topk(scores, valid, counts, k)
    rows, cols = scores.shape
    if k > cols:
        raise ValueError(f"select_top_columns: k = {k} exceeds the row's {cols} columns")
    out = torch.empty((rows, k), dtype=torch.long, device=scores.device)
    if out.numel() == 0:
        return out
    block = INTERPRETER_SELECT_BLOCK if interpreting() else SELECT_BLOCK
    programs = programs_per_row or _programs_per_row(scores.device, min(rows, SELECT_MAX_ROWS), cols, block)
    chunk = cdiv(cdiv(cols, programs), block) * block
    programs = cdiv(cols, chunk)
    scores = scores.contiguous()
    valid = None if valid is None else valid.contiguous()
    counts = None if counts is None else counts.contiguous()
    with on_device(scores.device):
        for first in range(0, rows, SELECT_MAX_ROWS):  # the workspace holds SELECT_MAX_ROWS rows' state
            stop = min(rows, first + SELECT_MAX_ROWS)
            _select_rows(scores[first:stop], None if valid is None else valid[first:stop],
                         None if counts is None else counts[first:stop], out[first:stop], k, chunk, programs, block)
    return out


def _select_rows(scores: Tensor, valid: Optional[Tensor], counts: Optional[Tensor], out: Tensor, k: int, chunk: int,
                 programs: int, block: int) -> None:
    from megatron_dsa.backends.triton_kernels import _topk_order_kernels as kernels

    rows, cols = scores.shape
    hist, tickets = _select_workspace(scores.device)
    state = torch.empty((rows, 2), dtype=torch.long, device=scores.device)
    part = torch.empty((rows, programs, 2), dtype=torch.int32, device=scores.device)
    has_valid = valid is not None
    masks = valid if has_valid else scores  # unread without a mask
    lengths = counts if counts is not None else state  # unread with a mask
    launch = dict(BLOCK=block, HAS_VALID=has_valid, num_warps=SELECT_WARPS, **chained_launch(scores.device))
    grid = (rows, programs)
    for level in range(SELECT_PASSES):
        launcher(kernels.select_digit_kernel)[grid](scores, masks, lengths, hist, tickets, state, cols, k, chunk,
                                                    programs, LEVEL=level, **launch)
    launcher(kernels.select_count_kernel)[grid](scores, masks, lengths, state, part, cols, chunk, programs, **launch)
    launcher(kernels.select_write_kernel)[grid](scores, masks, lengths, state, part, out, cols, k, chunk, programs,
                                                BLOCK_P=pow2(programs), **launch)


def _programs_per_row(device: torch.device, rows: int, cols: int, block: int) -> int:
    """About `PROGRAMS_PER_SM` programs per multiprocessor over the rows, each at least one block of columns."""
    return max(1, min(cdiv(cols, block), cdiv(programs_in_wave(device, PROGRAMS_PER_SM), rows)))


def _select_workspace(device: torch.device) -> tuple[Tensor, Tensor]:
    """The select's per-row histograms `[SELECT_MAX_ROWS, RADIX]` and tickets `[SELECT_MAX_ROWS]`, zero between
    calls (the kernels zero them after use), for kernels on the current stream of `device`."""
    return (zeros_per_stream("select_histograms", (SELECT_MAX_ROWS, RADIX), device),
            zeros_per_stream("select_tickets", (SELECT_MAX_ROWS,), device))


def order_picks(picked: Tensor, ranked: Tensor, valid: Tensor) -> Tensor:
    """`picked [T, K]` int32/int64 column ids (any order; invalid ids allowed), `ranked [T, RC]` float32
    scores with `RC >= C`, `valid [T, C]` bool → `[T, K]` int64 in reference order, −1 padded.

    A pick counts when it is in `[0, C)` and valid there; its score is `ranked[t, pick]`."""
    _check(picked, ranked, valid)
    from megatron_dsa.backends.triton_kernels import _topk_order_kernels as kernels

    rows, width = picked.shape
    out = torch.empty((rows, width), dtype=torch.long, device=picked.device)
    if out.numel() == 0:
        return out
    launcher(kernels.rank_columns_kernel)[(rows,)](
        picked.contiguous(), ranked.contiguous(), valid.contiguous(), out, width, valid.shape[1],
        ranked.shape[1], width, BLOCK_K=pow2(width), EVERY_COLUMN=False, num_warps=_warps(width))
    return out


def _warps(width: int) -> int:
    """Warps per row sort: one warp up to 1024 keys, one more per 1024 keys after that (at most 4, Triton's
    default). On an H100 the top-k of 4096 rows x 1024 columns took 0.114 ms with one warp, 0.214 with
    two, 0.314 with four (the sort's exchanges stay inside a warp); 512 picks took 0.054 / 0.059 ms."""
    return min(4, max(1, pow2(width) // 1024))


def _check_topk(scores: Tensor, valid: Optional[Tensor], counts: Optional[Tensor], k: int) -> None:
    """scores `[T, C]` float, and a valid mask of their shape or, without one, `counts [T]` int (the select's
    prefix form)."""
    if scores.dim() != 2 or (valid is not None and valid.shape != scores.shape):
        raise ValueError(f"triton top-k needs 2-D scores and a valid mask of their shape, got "
                         f"{tuple(scores.shape)} and {None if valid is None else tuple(valid.shape)}")
    if valid is None and (counts is None or counts.shape != scores.shape[:1] or counts.dtype.is_floating_point
                          or counts.dtype == torch.bool):
        raise ValueError(f"triton top-k without a valid mask needs integer counts [T = {scores.shape[0]}], got "
                         f"{None if counts is None else (tuple(counts.shape), counts.dtype)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"top-k k must be a non-negative int, got {k!r}")
    if min(k, scores.shape[1]) > MAX_WIDTH:
        raise ValueError(f"triton top-k orders at most {MAX_WIDTH} picks per row, got k = {k} of "
                         f"{scores.shape[1]} columns")
    if scores.dtype not in SCORE_DTYPES or (valid is not None and valid.dtype != torch.bool):
        raise TypeError(f"triton top-k needs float32/bfloat16/float16 scores and a bool valid mask, got "
                        f"{scores.dtype} and {None if valid is None else valid.dtype}")
    other = valid if valid is not None else counts
    if scores.device != other.device:
        raise ValueError(f"top-k scores and valid must share one device, got {scores.device}, {other.device}")
    require_triton(scores.device, "top-k", "scores' device")


def _check(picked: Tensor, ranked: Tensor, valid: Tensor) -> None:
    if picked.dim() != 2 or ranked.dim() != 2 or valid.dim() != 2:
        raise ValueError(f"order_picks needs 2-D picked, ranked and valid, got {tuple(picked.shape)}, "
                         f"{tuple(ranked.shape)}, {tuple(valid.shape)}")
    rows = picked.shape[0]
    if ranked.shape[0] != rows or valid.shape[0] != rows or ranked.shape[1] < valid.shape[1]:
        raise ValueError(f"order_picks rows disagree or ranked is narrower than valid: picked "
                         f"{tuple(picked.shape)}, ranked {tuple(ranked.shape)}, valid {tuple(valid.shape)}")
    if picked.shape[1] > MAX_WIDTH:
        raise ValueError(f"order_picks sorts at most {MAX_WIDTH} picks per row, got {picked.shape[1]}")
    if picked.dtype not in (torch.int32, torch.int64) or ranked.dtype != torch.float32 or valid.dtype != torch.bool:
        raise TypeError(f"order_picks needs int32/int64 picked, float32 ranked and bool valid, got "
                        f"{picked.dtype}, {ranked.dtype}, {valid.dtype}")
    if len({picked.device, ranked.device, valid.device}) != 1:
        raise ValueError(f"order_picks inputs must share one device, got {picked.device}, {ranked.device}, "
                         f"{valid.device}")
    require_triton(picked.device, "order_picks", "picked's device")
