"""Index rows: which KV rows each query token attends (−1 = no entry), docs/math.md §5 and §6.3.

KV rows live in the flat space `kv_full = [token rows (T) ; compressed rows (capacity)]`, so a
window entry is a token row id and compressed entry `c` is row `T + c`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Iterator, NamedTuple, Optional, Union

import torch
from torch import Tensor

from megatron_dsa.device_cache import KeepsDeviceValues, device_cached_property
from megatron_dsa.ops.layout import CompressedLayout, TokenLayout

INVALID = -1
KEPT_ROWS_ELEMENTS = 1 << 23  # visible-entry id matrices kept for reuse up to 64 MiB of int64


def small_enough_to_keep(rows: int, width: int) -> bool:
    """Whether an id matrix `[rows, width]` built from a layout is kept with it for reuse: these grow as
    `O(S²/r)`, so only while they hold at most `KEPT_ROWS_ELEMENTS` ids."""
    return rows * width <= KEPT_ROWS_ELEMENTS


def row_range(chunk: slice, rows: int) -> tuple[int, int]:
    """`(start, stop)` of the step-1 slice `chunk` over `rows` rows, as `chunk.indices(rows)` gives them.

    Plain Python because `torch.compile` traces the callers, and Dynamo (torch 2.11) cannot trace
    `slice.indices` (it breaks the graph)."""
    if chunk.step not in (None, 1):
        raise ValueError(f"row chunks are step-1 slices, got step {chunk.step}")

    def bound(value: Optional[int], default: int) -> int:
        if value is None:
            return default
        return min(max(value + rows if value < 0 else value, 0), rows)

    start = bound(chunk.start, 0)
    return start, max(start, bound(chunk.stop, rows))


def window_indices(layout: TokenLayout, window: int) -> Tensor:
    """`[T, W]` token rows `max(seg_start, t−W+1) … t`, then −1 padding (never a future row)."""
    t = torch.arange(layout.num_rows, device=layout.device)
    first = torch.maximum(layout.segment_starts, t - window + 1)
    rows = first.unsqueeze(1) + torch.arange(window, device=layout.device)
    return torch.where(rows <= t.unsqueeze(1), rows, INVALID)


@dataclass(frozen=True)
class UniformVisibleRows:
    """Query rows `[start, stop)` of a uniform batch whose visible entries follow the ratio-causal rule
    with no gaps: sequences of `seqlen` rows (batch-major), entry `j` of sequence `b` at compressed row
    `b·entries + j`, visible to the token at position `p` iff `j < (p + 1) // ratio`. Host ints only, so
    a kernel that computes these scores densely needs no id matrix and no device read."""

    seqlen: int
    entries: int
    ratio: int
    start: int
    stop: int


@dataclass(frozen=True)
class RowSegments:
    """Host description of a layout whose query rows come in runs of consecutive positions of one sequence
    each, every sequence with the same number of entries, all of them filled (a CP rank's extended pieces of
    an SBHD batch): `segments[i] = (rows, position of the first row, sequence)`, in row order."""

    ratio: int
    segments: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, eq=False)
class SegmentedVisibleRows:
    """Query rows `[start, stop)` of a `RowSegments` layout, for a kernel that scores each segment's rows densely
    against its sequence's entries (THD: one segment of query rows and one of keys per run; the keys are
    gathered in sequence order, once per segment). Row t of segment i sees entry j of its sequence iff
    `j < (first_positions[i] + t + 1) // ratio`, j < `keys`; column j of the scores is entry j.

    num_rows: the query rows (`stop − start`); cu_rows `[n + 1]` int32 query rows, cu_keys `[n + 1]` int32 keys
    (`i·keys`), first_positions `[n]` int32, key_rows `[n·keys]` long: the key buffer's rows holding entry j of
    segment i's sequence."""

    ratio: int
    num_rows: int
    max_rows: int
    keys: int
    cu_rows: Tensor
    cu_keys: Tensor
    first_positions: Tensor
    key_rows: Tensor


# What an `indexer_scores` call may be told of its candidates' structure (the family's `visible` hint).
VisibleStructure = Union[UniformVisibleRows, SegmentedVisibleRows]


@dataclass(frozen=True, eq=False)
class VisibleEntries(KeepsDeviceValues):
    """The compressed entries each query row may see, without a `[T, C]` matrix.

    Column `j` of row `t` is entry `j` of row `t`'s sequence, kept at row `table[group[t], j]` of the
    compressed buffer; it is visible when `j < count[t]` (ratio-causal, docs/math.md §5.3). The `[T, C]` id
    matrix is `O(S²/r)` (16 GiB of int64 at 64k rows × 32k entries), so it is only ever built in
    row chunks (`rows`).

    table: `[G, C]` buffer rows of each group's entries (−1 past its entries).
    group: `[T]` group (sequence) of each query row.  count: `[T]` visible entries of each row.
    """

    table: Tensor
    group: Tensor
    count: Tensor
    uniform: Optional[tuple[int, int, int]] = None  # (seqlen, entries, ratio) of a uniform batch
    segments: Optional[RowSegments] = None  # the rows' runs, where they are `RowSegments`

    @property
    def width(self) -> int:
        """`C`, the column count (the most entries any group has)."""
        return self.table.shape[1]

    def rows(self, chunk: Optional[slice] = None) -> Tensor:
        """`[n, C]` buffer rows visible to the query rows `chunk` (None: all), −1 elsewhere.

        All rows at once are built once and kept when they are small (`KEPT_ROWS_ELEMENTS`): a layout
        shared by every layer and step then saves six small ops per C layer forward, which matter at
        short sequences, where the host's launch time is a large part of a step. Callers never write into
        the result. (No `slice` default argument: Dynamo on torch 2.11 cannot bind one.)"""
        chunk = slice(None) if chunk is None else chunk
        return self._all_rows if self._kept(chunk) else self._rows(chunk)

    def valid(self, chunk: slice, rows: Tensor) -> Tensor:
        """`rows >= 0` for `rows = self.rows(chunk)`: the columns holding an entry, kept with the rows."""
        return self._all_valid if self._kept(chunk) else rows >= 0

    def prefix_counts(self, chunk: slice) -> Tensor:
        """`[n]` valid columns of each of the query rows `chunk`: row t's valid columns are exactly the prefix
        `[0, n_t)` (a group's entries fill its first table columns, and a row sees the first `count[t]` of
        them), which is the `topk` family's `counts` hint."""
        return self._prefix_counts[chunk]

    @device_cached_property
    def _prefix_counts(self) -> Tensor:
        entries_per_group = (self.table >= 0).sum(1)
        return torch.minimum(self.count, entries_per_group[self.group])

    def _kept(self, chunk: slice) -> bool:
        """Whether `chunk` is every query row and their rows are small enough to keep."""
        rows = self.group.shape[0]
        return row_range(chunk, rows) == (0, rows) and small_enough_to_keep(rows, self.width)

    @device_cached_property
    def _all_rows(self) -> Tensor:
        return self._rows(slice(None))

    @device_cached_property
    def _all_valid(self) -> Tensor:
        return self._all_rows >= 0

    def _rows(self, chunk: slice) -> Tensor:
        ids = self.table[self.group[chunk]]
        visible = torch.arange(self.width, device=ids.device) < self.count[chunk].unsqueeze(1)
        return torch.where(visible & (ids >= 0), ids, INVALID)

    def pick(self, columns: Tensor, rows: Optional[slice] = None) -> Tensor:
        """Buffer rows of the chosen `columns [n, K]` (entry numbers, −1 = none) of the query rows `rows`
        (None: all), −1 kept."""
        rows = slice(None) if rows is None else rows
        if self.width == 0:
            return torch.full_like(columns, INVALID)
        ids = self.table[self.group[rows].unsqueeze(1), columns.clamp_min(0)]
        return torch.where(columns >= 0, ids, INVALID)

    def uniform_rows(self, chunk: slice) -> Optional[UniformVisibleRows]:
        """The structure of the query rows `chunk` (a step-1 slice) when the batch is uniform, else None."""
        if self.uniform is None:
            return None
        start, stop = row_range(chunk, self.group.shape[0])
        return UniformVisibleRows(*self.uniform, start=start, stop=stop)

    def segmented_rows(self, chunk: slice) -> Optional[SegmentedVisibleRows]:
        """The structure of the query rows `chunk` (a step-1 slice) when the rows are `RowSegments`, else None;
        built once per chunk and kept."""
        if self.segments is None:
            return None
        start, stop = row_range(chunk, self.group.shape[0])
        return self.kept(self._per_chunk, ("segmented", start, stop), lambda: self._segmented(start, stop))

    @cached_property
    def _per_chunk(self) -> dict[tuple, object]:
        return {}

    def _segmented(self, start: int, stop: int) -> SegmentedVisibleRows:
        rows, first_positions, sequences, row = [], [], [], 0
        for length, first_position, sequence in self.segments.segments:
            low, high = max(start, row), min(stop, row + length)
            if high > low:
                rows.append(high - low)
                first_positions.append(first_position + low - row)
                sequences.append(sequence)
            row += length
        device, keys = self.table.device, self.width
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        return SegmentedVisibleRows(
            self.segments.ratio, stop - start, max(rows, default=0), keys, as_int32([0, *accumulate(rows)]),
            as_int32([keys * i for i in range(len(rows) + 1)]), as_int32(first_positions),
            self.table[torch.tensor(sequences, dtype=torch.long, device=device)].flatten())

    def row_chunks(self, elements: int) -> Iterator[slice]:
        """Query-row chunks holding about `elements` (row, column) pairs each."""
        step = max(1, elements // max(1, self.width))
        return (slice(start, start + step) for start in range(0, self.group.shape[0], step))


def visible_compressed_entries(layout: CompressedLayout) -> VisibleEntries:
    """Visible entries of a single-device layout: segment `b`'s entry `j` is compressed row
    `cu_compressed[b] + j`; token `t` sees `j < floor((pos_t+1)/r)` (its last token `(j+1)·r − 1 ≤ pos_t`)."""
    j = torch.arange(layout.max_entries, device=layout.tokens.device)
    entries = layout.cu_compressed[1:] - layout.cu_compressed[:-1]
    table = torch.where(j < entries.unsqueeze(1), layout.cu_compressed[:-1].unsqueeze(1) + j, INVALID)
    shape = layout.tokens.uniform_shape
    uniform = None if shape is None else (shape[1], shape[1] // layout.ratio, layout.ratio)
    return VisibleEntries(table, layout.tokens.segment_ids, layout.visible_counts(), uniform)


def visible_compressed_indices(layout: CompressedLayout) -> Tensor:
    """`[T, max_entries]` compressed row ids visible to each token, −1 padded (see `VisibleEntries`)."""
    return visible_compressed_entries(layout).rows()


def prefix_valid(valid: Optional[Tensor], counts: Optional[Tensor], columns: int) -> Tensor:
    """The `topk` family's valid mask: `valid`, or where it is None the prefixes `[0, counts[t])` of `columns`
    columns that `counts [T]` stands for (a decode step passes only its counts: a backend that scans prefixes
    never builds the `[T, C]` mask)."""
    if valid is not None:
        return valid
    if counts is None:
        raise ValueError("top-k needs a valid mask, or counts when every row's valid columns are a prefix")
    return torch.arange(columns, device=counts.device) < counts.unsqueeze(1)


def topk_columns(scores: Tensor, valid: Optional[Tensor], k: int, visible: Optional[UniformVisibleRows] = None,
                 counts: Optional[Tensor] = None, ordered: bool = True) -> Tensor:
    """Columns of the top-`k` valid scores per row, −1 where fewer than `k` are valid.

    scores: `[T, C]`; valid: `[T, C]` bool, or None with `counts` (`prefix_valid`). Returns `[T, min(k, C)]`
    int64: the valid columns, a valid column scoring −inf among them (ranked as the lowest finite score), highest
    score first, then −1; ties go to the lower column (stable sort), so the selection is deterministic.
    Non-differentiable. `visible` (the `topk` op family's optional hint, as for `indexer_scores`): `valid` is the
    visible-entry mask of these uniform-batch rows, a prefix of each row; `counts [T]` (the family's other hint,
    `0 ≤ counts[t] ≤ C`): `valid[t]` is the prefix `[0, counts[t])` of row t. `valid` says the same, so this
    ignores both.
    `ordered=False` (a caller that reads the picks as a set, such as a decode step's attention) lets a kernel
    return the same valid columns in any order, each once, with its other slots −1 or outside row t's valid
    columns; this returns the order above either way.
    """
    valid = prefix_valid(valid, counts, scores.shape[1])
    width = min(k, scores.shape[1])
    # A valid column scoring −inf ranks as the lowest finite score, so that it comes before every invalid
    # (−inf) column, whatever their columns (one elementwise op where a second sort by validity would cost 40%).
    lowest = torch.finfo(scores.dtype).min
    ranked = torch.where(valid, scores.detach().clamp_min(lowest), float("-inf"))
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :width]
    return torch.where(torch.gather(valid, 1, order), order, INVALID)


class SelectionRows(NamedTuple):
    """What the attention and the indexer loss read of a top-k selection, for its query rows `[n, ·]`."""

    entry_scores: Tensor  # [n, K] the picks' indexer scores, −inf at −1
    entry_rows: Tensor  # [n, K] the picks' rows of the compressed buffer, −1 kept
    compressed: Tensor  # [n, K] the same rows in kv_full (entry row + kv_offset), −1 kept
    combined: Tensor  # [n, W + K] the attention's index rows: the window's token rows, then `compressed`


def selection_rows(columns: Tensor, scores: Tensor, entries: VisibleEntries, rows: slice, window: Tensor,
                   kv_offset: int) -> SelectionRows:
    """The rows a top-k selection names (the `selection_rows` op family; fused kernels replace this).

    columns: `[n, K]` chosen entry numbers of the query rows `rows` (a step-1 slice of `entries`' rows),
    −1 = none. scores: `[n, C]` their indexer scores (the top-k's input). window: `[n, W]` token rows of
    their windows (−1 padded). kv_offset: where compressed rows start in kv_full (the token row count).
    """
    picked = columns >= 0
    entry_scores = torch.where(picked, scores.gather(1, columns.clamp_min(0)), float("-inf"))
    entry_rows = entries.pick(columns, rows)
    compressed = offset_valid(entry_rows, kv_offset)
    return SelectionRows(entry_scores, entry_rows, compressed, torch.cat((window, compressed), 1))


def offset_valid(indices: Tensor, offset: int) -> Tensor:
    """Add `offset` to valid ids only: −1 stays −1 (bug class A4.4)."""
    return torch.where(indices >= 0, indices + offset, INVALID)
