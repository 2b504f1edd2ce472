"""Packed-sequence (THD) input description, Megatron naming.

A packed batch is `[T, 1, hidden]`: segment `b` physically occupies rows
`cu_seqlens_q_padded[b] : cu_seqlens_q_padded[b+1]` (or `cu_seqlens_q` when there is no padding) and
its real tokens are the first `cu_seqlens_q[b+1] − cu_seqlens_q[b]` of those rows; the rest are
padding. Rows from the last padded boundary to `T` are a static-capacity tail. Padding and tail rows
produce zero output, get exactly zero input gradient and contribute to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class PackedSeqParams:
    """Segment boundaries of a packed batch (the fields Megatron-Core's `PackedSeqParams` uses).

    cu_seqlens_q / cu_seqlens_kv: `[nseg + 1]` int32 cumulative real lengths, starting at 0.
    cu_seqlens_q_padded / cu_seqlens_kv_padded: `[nseg + 1]` int32 physical boundaries (optional).
    max_seqlen_q / max_seqlen_kv: host ints bounding every (padded) segment length. Give them on
    CUDA: without them the layer reads the boundaries back from the device (a sync).
    """

    cu_seqlens_q: Tensor
    cu_seqlens_kv: Optional[Tensor] = None
    cu_seqlens_q_padded: Optional[Tensor] = None
    cu_seqlens_kv_padded: Optional[Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    qkv_format: str = "thd"


def validate_packed_seq_params(params: PackedSeqParams, num_rows: int) -> None:
    """Raise `ValueError`/`TypeError` naming the field and the rule it breaks.

    Structure (dtype, rank, length) is always checked. Values are checked only for tensors on the
    host, so CUDA metadata never forces a device sync (pass CPU copies to get the value checks).
    """
    if params.qkv_format != "thd":
        raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {params.qkv_format!r}")
    named = {"cu_seqlens_q": params.cu_seqlens_q, "cu_seqlens_kv": params.cu_seqlens_kv,
             "cu_seqlens_q_padded": params.cu_seqlens_q_padded,
             "cu_seqlens_kv_padded": params.cu_seqlens_kv_padded}
    for name, cu in named.items():
        if cu is not None:
            _check_cu_seqlens(name, cu, num_rows)
    segments = params.cu_seqlens_q.numel()
    for name, cu in named.items():
        if cu is not None and cu.numel() != segments:
            raise ValueError(f"{name} has {cu.numel()} entries but cu_seqlens_q has {segments}: "
                             f"every boundary tensor describes the same segments")
    _check_self_attention_pair("cu_seqlens_kv", params.cu_seqlens_kv, params.cu_seqlens_q)
    # Without q padding the physical layout is cu_seqlens_q, so kv padding must equal that.
    _check_self_attention_pair("cu_seqlens_kv_padded", params.cu_seqlens_kv_padded,
                               params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None
                               else params.cu_seqlens_q)
    padded = params.cu_seqlens_q_padded
    if padded is not None and _on_host(padded, params.cu_seqlens_q):
        short = (padded[1:] - padded[:-1]) < (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1])
        if bool(short.any()):
            segment = int(short.nonzero()[0])
            raise ValueError(f"cu_seqlens_q_padded must give every segment at least its real length; "
                             f"segment {segment} is shorter padded than unpadded")
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise TypeError(f"{name} must be a non-negative host int, got {value!r}")
    physical = padded if padded is not None else params.cu_seqlens_q
    if params.max_seqlen_q is not None and _on_host(physical):
        longest = int((physical[1:] - physical[:-1]).max()) if physical.numel() > 1 else 0
        if params.max_seqlen_q < longest:
            raise ValueError(f"max_seqlen_q ({params.max_seqlen_q}) is smaller than the longest "
                             f"(padded) segment ({longest})")


def _check_cu_seqlens(name: str, cu: Tensor, num_rows: int) -> None:
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (Megatron/TE convention), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with nseg + 1 >= 2 entries (at least one segment), "
                         f"got shape {tuple(cu.shape)}")
    if not _on_host(cu):
        return
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])} (non-canonical offsets: "
                         f"use megatron_dsa.packed_seq.canonicalize_cu_seqlens to narrow K/V first)")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if int(cu[-1]) > num_rows:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} exceeds the number of rows T = {num_rows}")


def _check_self_attention_pair(name: str, kv: Optional[Tensor], q: Optional[Tensor]) -> None:
    """Self-attention: kv boundaries, when given, must equal the q boundaries."""
    if kv is None or q is None or kv is q:
        return
    if _on_host(kv, q) and not torch.equal(kv, q):
        raise ValueError(f"{name} must equal its cu_seqlens_q counterpart in self-attention")


def _on_host(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def canonicalize_cu_seqlens(key: Tensor, value: Tensor, cu_seqlens_kv: Tensor
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """Make `cu_seqlens_kv` start at 0 by narrowing `key`/`value` `[T, ...]` to the rows it covers.

    A `cu_seqlens_kv` whose first entry is not 0 (e.g. a slice of a longer pack) is rejected by the
    layer; this returns `(key[c0:cN], value[c0:cN], cu_seqlens_kv − c0)`, views, no copy.
    Reads the two end offsets on the host.
    """
    start, stop = int(cu_seqlens_kv[0]), int(cu_seqlens_kv[-1])
    if start < 0 or stop < start or stop > key.shape[0] or key.shape[0] != value.shape[0]:
        raise ValueError(f"cu_seqlens_kv spans rows [{start}, {stop}) outside key/value with "
                         f"{key.shape[0]} / {value.shape[0]} rows")
    return key[start:stop], value[start:stop], cu_seqlens_kv - start


# Rows of the attention mask compared at once (bounds the temporary to this many rows × S × B).
_MASK_ROWS_PER_CHUNK = 1024


def documents_from_attention_mask(attention_mask: Tensor, batch: int, seqlen: int) -> Optional[Tensor]:
    """A Megatron attention mask → the documents it keeps apart, or None for the plain causal mask.

    `attention_mask`: bool, True = masked out, `[B | 1, 1, S, S]` or `[S, S]`. Accepted are the causal
    mask and a mask that is causal within documents (Megatron's `--reset-attention-mask`): token t
    starts a new document when it may not see token t − 1. Returns `cu_seqlens [ndoc + 1]` (int32,
    on the mask's device) of the batch-major rows `[B·S]`; reading the document starts back costs
    one host synchronisation. Any other mask raises ValueError: the layer cannot honour it.
    """
    if not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be a bool tensor (True = masked out), got "
                        f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)}")
    mask = attention_mask[None, None] if attention_mask.dim() == 2 else attention_mask
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch) or mask.shape[2:] != (seqlen, seqlen):
        raise ValueError(f"attention_mask must be [B={batch} or 1, 1, S={seqlen}, S] or [S, S], got "
                         f"{tuple(attention_mask.shape)}")
    mask = mask[:, 0]
    position = torch.arange(seqlen, device=mask.device)
    starts = torch.ones(mask.shape[0], seqlen, dtype=torch.bool, device=mask.device)
    starts[:, 1:] = mask[:, position[1:], position[1:] - 1]  # t may not see t − 1: a new document
    document = starts.cumsum(1)
    for first in range(0, seqlen, _MASK_ROWS_PER_CHUNK):
        rows = slice(first, first + _MASK_ROWS_PER_CHUNK)
        expected = (position[None, :] > position[rows, None]) | (document[:, rows, None] != document[:, None, :])
        if not torch.equal(mask[:, rows], expected):
            raise ValueError("attention_mask must be causal, or causal within documents (each token sees "
                             "the earlier tokens of its own document only); other masks are not supported "
                             "by the hybrid layer")
    if not bool(starts[:, 1:].any()):
        return None
    starts = starts.expand(batch, seqlen).flatten()
    bounds = torch.cat((starts.nonzero().flatten(), torch.tensor([batch * seqlen], device=mask.device)))
    return bounds.to(torch.int32)
