"""Row layouts: where each token and each compressed entry lives in the flat row space.

Core attention works on flat rows. A batch `[S, B, ...]` becomes `B` segments of `S` rows each
(batch-major), so SBHD and packed (THD) inputs share one code path: everything that must not cross
a sequence boundary (RoPE positions, window, compressor groups, visibility, top-k, loss) is computed
per segment from `cu_seqlens`. Metadata lives on the device; only capacities are host integers, so
nothing here synchronises with the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch
from torch import Tensor

from megatron_dsa.device_cache import DeviceCache, KeepsDeviceValues, device_cached_property

MAX_SHARED_LAYOUTS = 16  # uniform shapes kept (a training run uses one or two)


@dataclass(frozen=True, eq=False)
class TokenLayout(KeepsDeviceValues):
    """`T` token rows in contiguous segments.

    cu_seqlens: `[nseg + 1]` int64, segment `b` owns rows `cu_seqlens[b] : cu_seqlens[b+1]`.
    num_rows:   `T` (host int).
    max_seqlen: host-known upper bound on every segment length.
    """

    cu_seqlens: Tensor
    num_rows: int
    max_seqlen: int
    seqlens: Optional[Tensor] = None
    position_offsets: Optional[Tensor] = None  # [nseg] global position of each segment's row 0
    halo_lengths: Optional[Tensor] = None  # [nseg] leading rows that are context only, not queries

    @classmethod
    def uniform(cls, batch: int, seqlen: int, device: torch.device) -> "TokenLayout":
        """`batch` sequences of `seqlen` tokens, batch-major (row `b·S + s`).

        Shared per `(batch, seqlen, device)`: every layer and step of a shape reuses one layout and
        what was derived from it (its index rows are pure functions of the shape), which saves a few
        dozen small kernels per layer forward. Not shared when built inside a CUDA-graph capture
        (its tensors hold values only in the graph's replays)."""
        def build() -> "TokenLayout":
            cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device=device, dtype=torch.long)
            return cls(cu_seqlens=cu, num_rows=batch * seqlen, max_seqlen=seqlen)

        return _UNIFORM_LAYOUTS.get((batch, seqlen, torch.device(device)), device, build)

    @classmethod
    def packed(cls, cu_seqlens: Tensor, num_rows: int, device: torch.device,
               cu_seqlens_padded: Optional[Tensor] = None, max_seqlen: Optional[int] = None
               ) -> "TokenLayout":
        """Segments at `cu_seqlens_padded` (physical) holding `diff(cu_seqlens)` real tokens each.

        Without `max_seqlen` the longest physical segment is read back from the device.
        """
        physical = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
        if max_seqlen is None:
            if torch.compiler.is_compiling():
                raise ValueError("under torch.compile give the packed max_seqlen (packed_seq_params.max_seqlen_q): "
                                 "reading the longest segment back from the device would break the graph")
            max_seqlen = int((physical[1:] - physical[:-1]).max()) if physical.numel() > 1 else 0
        real = cu_seqlens.to(device=device, dtype=torch.long)
        return cls(cu_seqlens=physical.to(device=device, dtype=torch.long), num_rows=num_rows,
                   max_seqlen=max_seqlen, seqlens=real[1:] - real[:-1])

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @property
    def num_segments(self) -> int:
        return self.cu_seqlens.numel() - 1

    @device_cached_property
    def real_seqlens(self) -> Tensor:
        """`[nseg]` real (unpadded) length of each segment."""
        if self.seqlens is not None:
            return self.seqlens
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @device_cached_property
    def row_valid(self) -> Tensor:
        """`[T]` bool: the row is a real token (not per-segment padding, not the capacity tail)."""
        rows = torch.arange(self.num_rows, device=self.device)
        real = rows - self.segment_starts < self.real_seqlens[self.segment_ids]
        return real & (rows < self.cu_seqlens[-1])

    @device_cached_property
    def query_valid(self) -> Tensor:
        """`[T]` bool: a real token whose output is wanted (not padding, not a context-only halo row)."""
        if self.halo_lengths is None:
            return self.row_valid
        local = torch.arange(self.num_rows, device=self.device) - self.segment_starts
        return self.row_valid & (local >= self.halo_lengths[self.segment_ids])

    @property
    def uniform_shape(self) -> Optional[tuple[int, int]]:
        """`(B, S)` when the rows are `B` whole sequences of `S` tokens (`uniform`), else None.

        Host-side test only (no device read): no padding, halo or offsets, and `T = B·S` (segments of at
        most S rows that add up to B·S rows are all S long)."""
        if self.seqlens is not None or self.halo_lengths is not None or self.position_offsets is not None:
            return None
        if self.num_rows == 0 or self.num_rows != self.num_segments * self.max_seqlen:
            return None
        return self.num_segments, self.max_seqlen

    @property
    def has_padding(self) -> bool:
        """Host-known: padding or halo rows may exist (no device read)."""
        return self.seqlens is not None or self.halo_lengths is not None

    @device_cached_property
    def segment_ids(self) -> Tensor:
        """`[T]` segment of each row."""
        rows = torch.arange(self.num_rows, device=self.device)
        seg = torch.searchsorted(self.cu_seqlens, rows, right=True) - 1
        return seg.clamp_(0, self.num_segments - 1)

    @device_cached_property
    def segment_starts(self) -> Tensor:
        """`[T]` first row of each row's segment."""
        return self.cu_seqlens[self.segment_ids]

    @device_cached_property
    def positions(self) -> Tensor:
        """`[T]` position of each row in its sequence (RoPE restarts at 0 per segment; a segment
        that is a later piece of a sequence starts at its `position_offsets` entry)."""
        local = torch.arange(self.num_rows, device=self.device) - self.segment_starts
        if self.position_offsets is None:
            return local
        return local + self.position_offsets[self.segment_ids]

    def compressed(self, ratio: int) -> "CompressedLayout":
        return self.derived(("compressed", ratio), lambda: CompressedLayout.build(self, ratio))

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """`build()`, computed once per layout and `key`: for values that depend on the layout only
        (compressed layouts, index rows), so that layers sharing a layout share them (not kept when
        first built during a CUDA-graph capture of a layout built outside it; see `KeepsDeviceValues`)."""
        return self.kept(self._derived, key, build)

    @device_cached_property
    def _derived(self) -> dict[Hashable, Any]:
        return {}


@dataclass(frozen=True, eq=False)
class CompressedLayout(KeepsDeviceValues):
    """Compressed entries of a `TokenLayout` at ratio `r` (docs/math.md §4.1, §11).

    Segment `b` of length `L_b` has `C_b = floor(L_b / r)` entries; entry `j` summarises tokens
    `[j·r, (j+1)·r)` of its segment (plus group `j−1` for the overlapping r=4 compressor) and sits
    at RoPE position `j·r`. Rows `≥ cu_compressed[-1]` are unused capacity: they gather from a safe
    row and no index ever points at them.

    cu_compressed: `[nseg + 1]` int64.  capacity: host int, number of compressed rows allocated.
    max_entries:  host int, `max_seqlen // r` (width of "all visible entries" rows).
    """

    tokens: TokenLayout
    ratio: int
    cu_compressed: Tensor
    capacity: int
    max_entries: int
    first_entry: Optional[Tensor] = None  # [nseg] global index j of each segment's first entry

    @classmethod
    def build(cls, tokens: TokenLayout, ratio: int) -> "CompressedLayout":
        if ratio < 2:
            raise ValueError(f"compression ratio must be >= 2, got {ratio}")
        cu = torch.zeros_like(tokens.cu_seqlens)
        cu[1:] = torch.cumsum(tokens.real_seqlens // ratio, 0)  # padding is never compressed
        max_entries = tokens.max_seqlen // ratio
        capacity = min(tokens.num_rows // ratio, tokens.num_segments * max_entries)
        return cls(tokens=tokens, ratio=ratio, cu_compressed=cu, capacity=capacity,
                   max_entries=max_entries)

    @classmethod
    def owned(cls, tokens: TokenLayout, ratio: int, first_entry: Tensor, counts: Tensor,
              capacity: int) -> "CompressedLayout":
        """Segment `b` computes entries `first_entry[b] … first_entry[b] + counts[b] − 1` of its
        sequence (a segment that is a piece of a longer sequence: the entries whose last token it holds)."""
        cu = torch.zeros_like(tokens.cu_seqlens)
        cu[1:] = torch.cumsum(counts, 0)
        return cls(tokens=tokens, ratio=ratio, cu_compressed=cu, capacity=capacity,
                   max_entries=0, first_entry=first_entry)

    @device_cached_property
    def segment_ids(self) -> Tensor:
        """`[capacity]` segment of each compressed row (clamped for unused rows)."""
        rows = torch.arange(self.capacity, device=self.tokens.device)
        seg = torch.searchsorted(self.cu_compressed, rows, right=True) - 1
        return seg.clamp_(0, self.tokens.num_segments - 1)

    @device_cached_property
    def valid(self) -> Tensor:
        """`[capacity]` bool: the row is a real compressed entry."""
        return torch.arange(self.capacity, device=self.tokens.device) < self.cu_compressed[-1]

    @device_cached_property
    def entry_index(self) -> Tensor:
        """`[capacity]` index `j` of each compressed row within its segment (0 for unused rows)."""
        rows = torch.arange(self.capacity, device=self.tokens.device)
        local = rows - self.cu_compressed[self.segment_ids]
        if self.first_entry is not None:
            local = local + self.first_entry[self.segment_ids]
        return torch.where(self.valid, local, 0)

    @device_cached_property
    def positions(self) -> Tensor:
        """`[capacity]` RoPE position `j·r` of each compressed row."""
        return self.entry_index * self.ratio

    @device_cached_property
    def group_first_rows(self) -> Tensor:
        """`[capacity]` token row of the first token of each entry's own group (0 for unused)."""
        first = self.tokens.cu_seqlens[self.segment_ids] + self.entry_index * self.ratio
        if self.tokens.position_offsets is not None:
            first = first - self.tokens.position_offsets[self.segment_ids]
        return torch.where(self.valid, first, 0)

    @device_cached_property
    def pooled_group_starts(self) -> tuple[Tensor, Tensor]:
        """`(own, previous)`, `[capacity]` int64: the first token row of each entry's own group and of the
        group before it (which the overlapping ratio-4 compressor pools too); −1 for unused capacity
        rows, and (previous) for the first entry of a sequence."""
        own = torch.where(self.valid, self.group_first_rows, -1)
        previous = torch.where(self.entry_index > 0, own - self.ratio, -1)  # entry_index is 0 when unused
        return own, previous

    def visible_counts(self) -> Tensor:
        """`[T]` entries token `t` may see: `min(floor((pos+1)/r), C_b)` (ratio-causal, docs/math.md §5.3)."""
        causal = torch.div(self.tokens.positions + 1, self.ratio, rounding_mode="floor")
        entries = self.cu_compressed[1:] - self.cu_compressed[:-1]
        return torch.minimum(causal, entries[self.tokens.segment_ids])


_UNIFORM_LAYOUTS: DeviceCache[TokenLayout] = DeviceCache(max_entries=MAX_SHARED_LAYOUTS)
