"""A top-k selection's rows in one Triton kernel: a drop-in for `megatron_dsa.ops.indices.selection_rows`.

The torch form gathers the picks' scores, looks their buffer rows up in the entry table, offsets them
into kv_full and puts the window in front: about fifteen small ops per selection, each a kernel launch
between the top-k and the sparse attention, where the host's launch time decides the forward's pace.
One program per query row does it all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dsa.backends.triton_kernels.availability import require_triton
from megatron_dsa.backends.triton_kernels.lazy_jit import launcher
from megatron_dsa.backends.triton_kernels.tiles import pow2
from megatron_dsa.ops.indices import SelectionRows, VisibleEntries

SUPPORTED_SCORE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
MAX_BLOCK = 1024  # slots per loop step of one program


def selection_rows(columns: Tensor, scores: Tensor, entries: VisibleEntries, rows: slice, window: Tensor,
                   kv_offset: int) -> SelectionRows:
    """Same contract as `ops.indices.selection_rows` (shapes there)."""
    group = entries.group[rows]
    _check(columns, scores, entries, group, window)
    from megatron_dsa.backends.triton_kernels import _selection_kernels as kernels

    count, width = columns.shape
    device = columns.device
    entry_scores = torch.empty((count, width), dtype=scores.dtype, device=device)
    entry_rows, compressed = (torch.empty((count, width), dtype=torch.long, device=device) for _ in range(2))
    combined = torch.empty((count, window.shape[1] + width), dtype=torch.long, device=device)
    if count:
        table = entries.table.contiguous()
        launcher(kernels.selection_rows_kernel)[(count,)](
            columns.contiguous(), scores.contiguous(), table, group.contiguous(), window.contiguous(),
            entry_scores, entry_rows, compressed, combined, width, scores.shape[1], table.shape[1],
            window.shape[1], kv_offset, BLOCK=pow2(max(width, window.shape[1]), cap=MAX_BLOCK))
    return SelectionRows(entry_scores, entry_rows, compressed, combined)


def _check(columns: Tensor, scores: Tensor, entries: VisibleEntries, group: Tensor, window: Tensor) -> None:
    count = columns.shape[0] if columns.dim() == 2 else -1
    if columns.dim() != 2 or scores.dim() != 2 or window.dim() != 2 or scores.shape[0] != count or (
            window.shape[0] != count or group.shape[0] != count):
        raise ValueError(f"selection_rows needs columns [n, K], scores [n, C] and window [n, W] of the n query rows "
                         f"chosen from the entries, got columns {tuple(columns.shape)}, scores "
                         f"{tuple(scores.shape)}, window {tuple(window.shape)} and {group.shape[0]} rows")
    if columns.shape[1] > scores.shape[1]:
        raise ValueError(f"selection_rows has {columns.shape[1]} picks per row but only {scores.shape[1]} "
                         f"scored columns")
    if scores.shape[1] > entries.width:
        raise ValueError(f"selection_rows scores have {scores.shape[1]} columns, the entry table {entries.width}")
    if columns.dtype != torch.long or window.dtype != torch.long or entries.table.dtype != torch.long:
        raise TypeError(f"selection_rows needs int64 columns, window and entry table, got {columns.dtype}, "
                        f"{window.dtype}, {entries.table.dtype}")
    if scores.dtype not in SUPPORTED_SCORE_DTYPES:
        raise TypeError(f"selection_rows scores must be one of {SUPPORTED_SCORE_DTYPES}, got {scores.dtype}")
    devices = {columns.device, scores.device, window.device, entries.table.device, group.device}
    if len(devices) != 1:
        raise ValueError(f"selection_rows inputs must share one device, got {sorted(map(str, devices))}")
    require_triton(columns.device, "selection_rows", "columns' device")
