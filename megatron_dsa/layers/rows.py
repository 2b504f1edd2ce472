"""Row contexts: the token rows one layer call attends over, and where their keys come from.

A layer's attention works on flat token rows (`ops.layout`). Which rows those are, and which keys
and compressed entries their queries see, depends on how the sequence is held: whole on this process
(`LocalRows`) or split over context-parallel ranks (`layers.context_parallel.ContextParallelRows`).
(New rows appended to a decoding cache take their own step, `layers.decoding`: their keys come from
the cache's buffers, not from rows of this call.) The layer gets the row context of each call from
`token_rows` (shared by calls of the same input where it can be) and its cores ask it, never the
parallel setup, for what they need:

| call | gives |
|---|---|
| `enter(hidden)` | `[S, B, d]` (packed `[T, 1, d]`) → the rows attended `[N, d]` (context rows added, padding zeroed) |
| `leave(latent)` | `[N, F]` → `[S, B, F]` (packed `[T, 1, F]`): context rows dropped, padding zeroed |
| `layout` | the `TokenLayout` of the `N` rows (positions global within each sequence) |
| `outputs(rows)` | `[N, ...]` → the rows whose outputs this call returns (context rows dropped) |
| `compressed_layout(r)` | where the entries this call pools at ratio `r` live |
| `visible_entries(r)` | each row's visible entries, as rows of the buffer `gather_entries` gives |
| `gather_entries(pooled, r)` | starts moving the pooled entries to that buffer; the returned call gives it |
| `attend_causal(q, keys, scale, backend)` | causal attention of the rows' queries over every key of their sequences (`keys`: a `KeyValueSource`, expanded here or carried by the CP ring) |
| `real_query_count` | real query rows of the whole batch: the divisor of the mean indexer loss |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

import torch
from torch import Tensor

from megatron_dsa.backends import OpFamily, Requested, dispatch
from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.ops.indices import VisibleEntries, visible_compressed_entries
from megatron_dsa.ops.layout import CompressedLayout, TokenLayout
from megatron_dsa.layers.context_parallel import ContextParallelRows, KeyValueSource
from megatron_dsa.packed_seq import (PackedSeqParams, check_packed_hidden_states, documents_from_attention_mask,
                                     validate_packed_seq_params)
from megatron_dsa.parallel.state import ParallelState


class TokenRows(Protocol):
    """What a layer and its cores ask about the rows of one call (see the module docstring)."""

    @property
    def layout(self) -> TokenLayout: ...

    @property
    def real_query_count(self) -> Union[int, Tensor]: ...

    def enter(self, hidden: Tensor) -> Tensor: ...

    def leave(self, latent: Tensor) -> Tensor: ...

    def outputs(self, rows: Tensor) -> Tensor: ...

    def compressed_layout(self, ratio: int) -> CompressedLayout: ...

    def visible_entries(self, ratio: int) -> VisibleEntries: ...

    def gather_entries(self, pooled: Tensor, ratio: int) -> Callable[[], Tensor]: ...

    def attend_causal(self, q: Tensor, keys: KeyValueSource, scale: float, backend: Requested) -> Tensor: ...


@dataclass(frozen=True, eq=False)
class LocalRows:
    """Every token of every sequence, on this process: the rows are the input's own.

    `batch` is B of a `[S, B, d]` input (rows batch-major, `b·S + s`), None for packed `[T, 1, d]`
    input, whose padding rows are zeroed on the way in and out: nothing non-finite reaches a
    product, their outputs are exactly 0 and their input gradients exactly 0."""

    layout: TokenLayout
    batch: Optional[int]

    def enter(self, hidden: Tensor) -> Tensor:
        if self.batch is None:
            return torch.where(self.layout.row_valid.unsqueeze(1), hidden[:, 0], 0.0)
        return hidden.transpose(0, 1).reshape(self.layout.num_rows, -1)

    def leave(self, latent: Tensor) -> Tensor:
        if self.batch is None:
            return torch.where(self.layout.row_valid.unsqueeze(1), latent, 0.0).unsqueeze(1)
        return latent.view(self.batch, -1, latent.shape[-1]).transpose(0, 1)

    def outputs(self, rows: Tensor) -> Tensor:
        return rows

    def compressed_layout(self, ratio: int) -> CompressedLayout:
        return self.layout.compressed(ratio)

    def visible_entries(self, ratio: int) -> VisibleEntries:
        # Kept with the layout: layers and steps sharing a layout build them once.
        return self.layout.derived(("visible_entries", ratio),
                                   lambda: visible_compressed_entries(self.compressed_layout(ratio)))

    def gather_entries(self, pooled: Tensor, ratio: int) -> Callable[[], Tensor]:
        return lambda: pooled

    def attend_causal(self, q: Tensor, keys: KeyValueSource, scale: float, backend: Requested) -> Tensor:
        """q `[N, H, Dqk]` over the keys' expanded k `[N, G, Dqk]`, v `[N, G, Dv]` → `[N, H, Dv]`, causal
        within each segment."""
        k, v = keys.expand()
        attend = dispatch(OpFamily.DENSE_ATTENTION, backend, device=q.device, dtype=q.dtype,
                          head_dim=q.shape[-1], v_head_dim=v.shape[-1], heads=q.shape[1], groups=k.shape[1],
                          layout=self.layout, lse_grad=False)  # the layer uses only `out`
        out, _ = attend(q, k, v, self.layout, scale)
        return out

    @property
    def real_query_count(self) -> Union[int, Tensor]:
        """All rows without padding; else the real ones, counted on the device (no host sync)."""
        return self.layout.query_valid.sum() if self.layout.has_padding else self.layout.num_rows


def token_rows(hidden: Tensor, attention_mask: Optional[Tensor], packed: Optional[PackedSeqParams],
               parallel_state: ParallelState, config: HybridAttentionConfig, halo: int) -> TokenRows:
    """The row context of one layer call on the gathered input `hidden` (`[S, B, d]`, packed `[T, 1, d]`).

    `attention_mask` (Megatron's: bool, True = masked out, `[B | 1, 1, S, S]`): None or the causal mask
    give causal attention; a mask that is causal within documents runs every document on its own, as
    packed input does (one host sync to read the documents); any other mask raises ValueError.
    `halo`: the rows before a piece of a sequence its first tokens read (the kind's rule), fetched
    from the ranks that hold them when the sequence is split over context-parallel ranks."""
    documents = _documents(attention_mask, hidden, packed, parallel_state)
    if parallel_state.cp_size > 1:
        return ContextParallelRows.for_input(hidden, packed, parallel_state, config, halo)
    seqlen, batch, _ = hidden.shape
    if packed is not None:
        check_packed_hidden_states(hidden)
        validate_packed_seq_params(packed, seqlen)
        return LocalRows(TokenLayout.packed(packed.cu_seqlens_q, seqlen, hidden.device, packed.cu_seqlens_q_padded,
                                            packed.max_seqlen_q), None)
    layout = (TokenLayout.uniform(batch, seqlen, hidden.device) if documents is None
              else TokenLayout.packed(documents, batch * seqlen, hidden.device))
    return LocalRows(layout, batch)


def _documents(attention_mask: Optional[Tensor], hidden: Tensor, packed: Optional[PackedSeqParams],
               parallel_state: ParallelState) -> Optional[Tensor]:
    """`cu_seqlens` of the documents a document mask keeps apart (batch-major rows), or None."""
    if attention_mask is None:
        return None
    if packed is not None:
        raise ValueError("give attention_mask or packed_seq_params, not both: packed input takes its "
                         "documents from packed_seq_params.cu_seqlens_q")
    cp = parallel_state.cp_size
    documents = documents_from_attention_mask(attention_mask, hidden.shape[1], hidden.shape[0] * cp)
    if documents is not None and cp > 1:
        raise ValueError("a document attention_mask is not supported under context parallelism: pass the "
                         "documents as packed_seq_params (THD, host cu_seqlens_q) instead")
    return documents
