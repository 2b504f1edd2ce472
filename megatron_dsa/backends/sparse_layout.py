"""Layout glue between our sparse-attention contract and the vendor kernels (FlashMLA, cuDNN DSA).

Ours: `query [N, H, D]` flat rows, `kv [M, D]`, `indices [N, K]` int32/int64 with anything outside
`[0, M)` invalid, any `H` and `K`, natural-log LSE without the sink, −inf for a row without keys.
Theirs: int32 ids with −1 as the only sentinel we rely on, `K` a multiple of the kernel's tile, head
counts of 64 or 128 (Hopper kernels are built for 64-head tiles), `+inf` LSE on empty rows.

Fewer heads (tensor parallelism splits them: 32 per rank at TP-2 of 64) are padded with zero heads,
one chunk of rows at a time (`padded_row_chunks`): padded copies of every row's q, out and dO would be
twice the rank's own tensors and take back the memory that splitting the heads saves.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from megatron_dsa.backends.probes import round_up

HEAD_TILE = 64  # the sparse MLA kernels run 64 or 128 query heads per KV head
MAX_HEADS = 128
INT32_ROWS = 2 ** 31 - 1  # ids are int32 on the kernel side (bug class A4.4 overflow variant)
# Elements of one head-padded `[rows, 64 | 128, D]` copy made at once (256 MiB of bf16, 4096 rows at 64 x 512).
PADDED_CHUNK_ELEMENTS = 1 << 27


def padded_heads(heads: int) -> int:
    """64 or 128: the head count the kernels accept, padding `heads` up (TP-sharded heads below 64)."""
    return round_up(max(heads, 1), HEAD_TILE)


def heads_problem(heads: int) -> str | None:
    if heads > MAX_HEADS:
        return f"{heads} local heads unsupported (at most {MAX_HEADS})"
    return None


def kv_rows_problem(call: Mapping[str, Any]) -> str | None:
    """A call description whose kv rows int32 ids cannot address (None: fine or not known)."""
    rows = call.get("kv_rows")
    return f"{rows} kv rows exceed int32 ids" if rows is not None and rows > INT32_ROWS else None


def pad_heads(t: Tensor, heads: int, value: float = 0.0) -> Tensor:
    """Pad dim 1 (`[N, H, ...]`) or dim 0 of a `[H]` vector to `heads` with `value`."""
    dim = 0 if t.dim() == 1 else 1
    missing = heads - t.shape[dim]
    if missing == 0:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat((t, t.new_full(shape, value)), dim).contiguous()


def padded_row_chunks(rows: int, heads: int, head_dim: int) -> list[slice]:
    """The row slices to call a head-padded kernel on: all rows at once when `heads` needs no padding
    (nothing is copied), else chunks whose padded `[n, padded_heads(heads), head_dim]` copies hold at
    most `PADDED_CHUNK_ELEMENTS` elements. Always at least one slice (an empty one for no rows)."""
    width = padded_heads(heads)
    step = rows if width == heads else max(1, PADDED_CHUNK_ELEMENTS // (width * head_dim))
    return [slice(start, start + step) for start in range(0, rows, step)] or [slice(0, rows)]


def rows_in_chunks(run: Callable[[slice], Sequence[Tensor]], chunks: Sequence[slice], rows: int) -> list[Tensor]:
    """`run(chunk)` → per-row outputs `[n, ...]` of the chunk's rows; returns the outputs of all `rows`.
    Several chunks: each chunk's outputs are copied into full-size outputs as soon as it returns, so one
    chunk's padded kernel outputs are alive at a time. One chunk: `run`'s outputs as they are."""
    if len(chunks) == 1:
        return list(run(chunks[0]))
    outputs: list[Tensor] = []
    for chunk in chunks:
        parts = run(chunk)
        if not outputs:
            outputs = [part.new_empty((rows, *part.shape[1:])) for part in parts]
        for output, part in zip(outputs, parts):
            output[chunk] = part
    return outputs


def kernel_ids(indices: Tensor, kv_rows: int, alignment: int) -> Tensor:
    """`[N, K]` → `[N, round_up(K, alignment)]` int32 global row ids, −1 at every invalid slot.

    Ids `≥ M` are mapped to −1 too: some kernels accept them as invalid, but −1 is the one sentinel
    every kernel documents. Padding slots are −1 (never 0: bug class A4.2)."""
    valid = (indices >= 0) & (indices < kv_rows)
    ids = torch.where(valid, indices, -1).to(torch.int32)
    width = round_up(max(indices.shape[1], 1), alignment)
    if width == ids.shape[1]:
        return ids.contiguous()
    pad = ids.new_full((ids.shape[0], width - ids.shape[1]), -1)
    return torch.cat((ids, pad), 1).contiguous()


def empty_rows(indices: Tensor, kv_rows: int) -> Tensor:
    """`[N]` bool: the row has no valid index (its out is 0 and its lse −inf in our contract)."""
    return ~((indices >= 0) & (indices < kv_rows)).any(1)
