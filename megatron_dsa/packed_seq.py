"""Packed-sequence (THD) input description, Megatron naming.

A packed batch is `[T, 1, hidden]`: segment `b` physically occupies rows
`cu_seqlens_q_padded[b] : cu_seqlens_q_padded[b+1]` (or `cu_seqlens_q` when there is no padding) and
its real tokens are the first `cu_seqlens_q[b+1] − cu_seqlens_q[b]` of those rows; the rest are
padding. Rows from the last padded boundary to `T` are a static-capacity tail. Padding and tail rows
produce zero output, get exactly zero input gradient and contribute to nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron_dsa.device_cache import capturing_now


@dataclass
class PackedSeqParams:
    """Segment boundaries of a packed batch (the fields Megatron-Core's `PackedSeqParams` uses).

    cu_seqlens_q / cu_seqlens_kv: `[nseg + 1]` int32 cumulative real lengths, starting at 0.
    cu_seqlens_q_padded / cu_seqlens_kv_padded: `[nseg + 1]` int32 physical boundaries (optional).
    max_seqlen_q / max_seqlen_kv: host ints bounding every (padded) segment length. Give them on
    CUDA: without them the layer reads the boundaries back from the device (a sync). The values of CUDA
    boundaries are checked on the device (see `validate_packed_seq_params`).
    """

    cu_seqlens_q: Tensor
    cu_seqlens_kv: Optional[Tensor] = None
    cu_seqlens_q_padded: Optional[Tensor] = None
    cu_seqlens_kv_padded: Optional[Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    qkv_format: str = "thd"


# Set to 1 to read CUDA packed metadata back to the host (one sync per call) and check its values with
# the same clear errors as CPU metadata; without it, CUDA values are checked by device-side asserts.
VALIDATE_PACKED_ENV = "MEGATRON_DSA_VALIDATE_PACKED"

_CU_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def check_packed_hidden_states(hidden_states: Tensor) -> None:
    """Packed (THD) input is `[T, 1, hidden]`: one row of tokens, the sequences told by `cu_seqlens`."""
    if hidden_states.shape[1] != 1:
        raise ValueError(f"packed (THD) hidden_states must be [T, 1, hidden], got {tuple(hidden_states.shape)}")


def validate_packed_seq_params(params: PackedSeqParams, num_rows: int,
                               read_device_values: Optional[bool] = None) -> None:
    """Raise `ValueError`/`TypeError` naming the field and the rule it breaks.

    Structure (types, dtype, rank, length, host ints) is always checked, and the values of host tensors.
    Values of device (CUDA) tensors: with `read_device_values` (default: the environment variable
    `MEGATRON_DSA_VALIDATE_PACKED=1`) they are read back, one host sync, and checked like host values;
    otherwise the same rules run as one device-side assert (no sync; a violation stops the process with
    "device-side assert triggered", and the variable then names the rule). Nothing is checked on the
    device during a CUDA-graph capture: a graphed layer checks its inputs before each replay. Under
    `torch.compile` the values are checked by the device-side assert, host tensors included.
    """
    if params.qkv_format != "thd":
        raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {params.qkv_format!r}")
    named = {name: getattr(params, name) for name in _CU_FIELDS}
    for name, cu in named.items():
        if cu is not None:
            _check_cu_structure(name, cu)
    segments = params.cu_seqlens_q.numel()
    for name, cu in named.items():
        if cu is not None and cu.numel() != segments:
            raise ValueError(f"{name} has {cu.numel()} entries but cu_seqlens_q has {segments}: "
                             f"every boundary tensor describes the same segments")
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise TypeError(f"{name} must be a non-negative host int, got {value!r}")
    tensors = [cu for cu in named.values() if cu is not None]
    if torch.compiler.is_compiling():
        # Reading values back would break the traced graph: the rules run as the device-side assert.
        torch._assert_async(packed_values_hold(params, num_rows))
    elif all(cu.device.type == "cpu" for cu in tensors):
        _check_values(named, params.max_seqlen_q, num_rows)
    elif _reads_device_values(read_device_values):
        _check_values({name: None if cu is None else cu.cpu() for name, cu in named.items()},
                      params.max_seqlen_q, num_rows)
    elif not capturing_now():
        torch._assert_async(packed_values_hold(params, num_rows))


def _reads_device_values(requested: Optional[bool]) -> bool:
    if requested is None:
        requested = os.environ.get(VALIDATE_PACKED_ENV, "0") not in ("", "0")
    if requested and capturing_now():
        raise RuntimeError(f"packed metadata values cannot be read back during a CUDA-graph capture; unset "
                           f"{VALIDATE_PACKED_ENV} for the capture (graphed layers check before each replay)")
    return requested


def _check_cu_structure(name: str, cu: Tensor) -> None:
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (Megatron/TE convention), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with nseg + 1 >= 2 entries (at least one segment), "
                         f"got shape {tuple(cu.shape)}")


def _check_values(named: dict[str, Optional[Tensor]], max_seqlen_q: Optional[int], num_rows: int) -> None:
    """The value rules on host tensors, each with its own message."""
    for name, cu in named.items():
        if cu is None:
            continue
        if int(cu[0]) != 0:
            raise ValueError(f"{name} must start at 0, got {int(cu[0])} (non-canonical offsets: "
                             f"use megatron_dsa.packed_seq.canonicalize_cu_seqlens to narrow K/V first)")
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
        if int(cu[-1]) > num_rows:
            raise ValueError(f"{name}[-1] = {int(cu[-1])} exceeds the number of rows T = {num_rows}")
    for kv_name, q_name in _SELF_ATTENTION_PAIRS:
        kv, q = named[kv_name], _q_counterpart(named, q_name)
        if kv is not None and not torch.equal(kv, q):
            raise ValueError(f"{kv_name} must equal its {q_name} counterpart in self-attention "
                             f"(got {kv.tolist()} and {q.tolist()})")
    real, padded = named["cu_seqlens_q"], named["cu_seqlens_q_padded"]
    if padded is not None:
        short = (padded[1:] - padded[:-1]) < (real[1:] - real[:-1])
        if bool(short.any()):
            segment = int(short.nonzero()[0])
            raise ValueError(f"cu_seqlens_q_padded must give every segment at least its real length; "
                             f"segment {segment} is shorter padded than unpadded")
    physical = padded if padded is not None else real
    if max_seqlen_q is not None:
        longest = int((physical[1:] - physical[:-1]).max())
        if max_seqlen_q < longest:
            raise ValueError(f"max_seqlen_q ({max_seqlen_q}) is smaller than the longest "
                             f"(padded) segment ({longest})")


# Self-attention: kv boundaries, when given, equal the q ones. Without q padding the physical layout is
# cu_seqlens_q, so kv padding must equal that.
_SELF_ATTENTION_PAIRS = (("cu_seqlens_kv", "cu_seqlens_q"), ("cu_seqlens_kv_padded", "cu_seqlens_q_padded"))


def _q_counterpart(named: dict[str, Optional[Tensor]], q_name: str) -> Tensor:
    return named[q_name] if named[q_name] is not None else named["cu_seqlens_q"]


def packed_values_hold(params: PackedSeqParams, num_rows: int) -> Tensor:
    """A bool scalar on the metadata's device: every value rule of `validate_packed_seq_params` holds
    (starts at 0, non-decreasing, within `num_rows`, kv equal to q, padded segments at least their real
    length, `max_seqlen_q` bounding them). Computed without reading anything back; the structure must
    already be valid."""
    named = {name: getattr(params, name) for name in _CU_FIELDS}
    real = named["cu_seqlens_q"]
    checks = []
    for cu in (t for t in named.values() if t is not None):
        steps = cu[1:] - cu[:-1]
        checks += [cu[0] == 0, (steps >= 0).all(), cu[-1] <= num_rows]
    for kv_name, q_name in _SELF_ATTENTION_PAIRS:
        if named[kv_name] is not None:
            checks.append((named[kv_name] == _q_counterpart(named, q_name).to(named[kv_name].device)).all())
    physical = named["cu_seqlens_q_padded"] if named["cu_seqlens_q_padded"] is not None else real
    lengths = physical[1:] - physical[:-1]
    if named["cu_seqlens_q_padded"] is not None:
        checks.append((lengths >= (real[1:] - real[:-1]).to(lengths.device)).all())
    if params.max_seqlen_q is not None:
        checks.append((lengths <= params.max_seqlen_q).all())
    return torch.stack([check.to(real.device) for check in checks]).all()


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
