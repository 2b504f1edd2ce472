"""Layout glue between our sparse-attention contract and the vendor kernels (FlashMLA, cuDNN DSA).

Ours: `query [N, H, D]` flat rows, `kv [M, D]`, `indices [N, K]` int32/int64 with anything outside
`[0, M)` invalid, any `H` and `K`, natural-log LSE without the sink, −inf for a row without keys.
Theirs: int32 ids with −1 as the only sentinel we rely on, `K` a multiple of the kernel's tile, head
counts of 64 or 128 (Hopper kernels are built for 64-head tiles), `+inf` LSE on empty rows.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from megatron_dsa.backends.probes import round_up

HEAD_TILE = 64  # the sparse MLA kernels run 64 or 128 query heads per KV head
MAX_HEADS = 128
INT32_ROWS = 2 ** 31 - 1  # ids are int32 on the kernel side (bug class A4.4 overflow variant)


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
