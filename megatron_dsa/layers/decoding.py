"""Incremental decoding: a per-layer inference cache and the layer step that reads and extends it.

A layer called with a `LayerCache` attends its new rows over everything the cache holds for their
sequence, then appends them: a prompt is prefilled in chunks of any length, then tokens are decoded
one at a time, and every output equals the full-sequence forward's row (docs/user_guide.md, "Generate").

What one layer keeps per sequence:

| kind | cached | per token |
|---|---|---|
| W | the last `W−1` K = V rows (a ring buffer) | 0 |
| H | the window ring; the compressor's unfinished group (its `kv` / `gate` projections); the compressed entries | `D / r` |
| C | as H, the unfinished group also holding the previous group (the overlap half of ratio 4); the indexer's compressor state and compressed keys (optionally FP8: e4m3 and one float32 scale per key) | `(D + DI) / r` |
| M | the latent KV: normalised `kv_lora_rank` latent and the RoPE key | `kv_lora_rank + P` |

Optionally (`LayerCache.for_layer(..., fp8_attention_rows=True)`) W/C/H layers keep the window and the compressed
entries as e4m3 pages (`ops.paged_rows`, FlashMLA's FP8 decode cache at dsv4 dims): every row a query attends is
then rounded so, and a decode step attends through the `paged_decode_attention` family.

Each sequence has its own length (`seqlens`, FlashAttention's `cache_seqlens`): a batch's prompts may
differ in length (prefill them packed, THD), and a packed call may give a sequence no new tokens.
The cache is preallocated for `capacity` tokens per sequence. Inference only: the step runs the layer
in its weights' autograd, but the cache's buffers are written in place, so no gradient flows through
them (call it under `torch.no_grad()` / `torch.inference_mode()`). Runs on one process (tensor
parallelism splits heads as the layer does; context parallelism is not supported).

Two paths:
- `attend_cached`, the readable reference: any number of new tokens per sequence (prefill chunks, packed
  prompts); it gathers the rows each query reads and up-projects M's cached latents each step (no weight
  absorption). It reads the new lengths back to the host once per call.
- `decode_step`, one new token per sequence (the layer takes it for every `[1, B, d]` call): fixed shapes, no
  host sync, every cache write in place, so it can be captured in a CUDA graph (`DecodeGraph`). The attention
  is the `decode_attention` op family (a split-K Triton kernel on CUDA). An M layer absorbs its up-projection
  into the query and the output (MLA's weight absorption: scores `q_nope·W_k·latent + q_rope·k_rope`, values
  `W_v · Σ p·latent`), so its cached `[latent | k_rope]` rows are the family's K = V rows (its ring: every cached
  position), with no sink, and the first `kv_lora_rank` output columns are the latent to up-project; an M
  layer whose `linear_kv_up_proj` is not a plain weight (`DenseMLACore.plain_up_weight`) keeps the reference.
  a C layer's indexer scores each sequence's cached compressed keys where they lie (`decode_indexer_scores`,
  then `topk`), and each compressor's write is one `decode_compressor` call (one kernel on CUDA): the new token
  into its pending slot, and the one entry of its group pooled and stored (complete or not: an unfinished entry
  is not visible yet). The step ends with one `decode_append` call (one kernel on CUDA): the new K = V row into
  the window ring (M: the latent row into its position) and the lengths counted up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from megatron_dsa.backends import OpFamily, dispatch
from megatron_dsa.backends.dispatched_sparse_attention import sparse_attention
from megatron_dsa.config import KINDS, lookup_kind
from megatron_dsa.layers.compressed_attention import Compressor, IndexSelection, LightningIndexer
from megatron_dsa.layers.cores import DenseMLACore
from megatron_dsa.layers.streams import beside
from megatron_dsa.ops.compressor import OVERLAP_RATIO, channel_factor
from megatron_dsa.ops.decode_attention import entry_counts
from megatron_dsa.ops.decode_compressor import byte_view, encode_rows, pending_slots
from megatron_dsa.ops.fp8_linear import RoundedWeights, dequantize_rows, rounded_rows
from megatron_dsa.ops.indexer import FP8_KEYS
from megatron_dsa.ops.indices import INVALID, VisibleEntries, offset_valid
from megatron_dsa.ops.layout import CompressedLayout, TokenLayout
from megatron_dsa.ops import paged_rows
from megatron_dsa.ops.paged_rows import PagedRows, all_rows, round_trip, write_rows
from megatron_dsa.ops.precision import compute_dtype
from megatron_dsa.ops.stacked_projection import KeptStack

if TYPE_CHECKING:
    from megatron_dsa.config import HybridAttentionConfig
    from megatron_dsa.layers.hybrid_attention import HybridAttention

# Entry slots per sequence are a multiple of this: a C layer's decode scores `[B, slots]` (float32) then have
# 32-byte rows, which cuDNN's top-k takes as they are (otherwise every step padded them: a fill and a copy,
# 6.4 µs at B = 32 and 32k entries on an H200).
ENTRY_SLOT_MULTIPLE = 8


@dataclass(frozen=True)
class CompressorState:
    """A compressor's unfinished tokens: `rows [B, K, 2·coff·Dc]`, the `kv` then the `gate` projections of the
    last `K` positions at slot `position % K` (`K = 2r` for the overlapping ratio 4, else `r`). Side by side
    in one buffer, as they come out of the stacked projection GEMM: a decode step writes and reorders both
    with one op each."""

    rows: Tensor

    @classmethod
    def empty(cls, batch: int, slots: int, width: int, dtype: torch.dtype, device: torch.device
              ) -> "CompressorState":
        return cls(torch.zeros(batch, slots, 2 * width, dtype=dtype, device=device))

    @property
    def slots(self) -> int:
        return self.rows.shape[1]


@dataclass
class LayerCache:
    """What one layer keeps of `batch` sequences of at most `capacity` tokens (see the module docstring).

    seqlens: `[B]` int64 tokens cached per sequence (updated in place: a captured decode step reads it where it
    is); `longest` a host-side upper bound of its largest value (checked against `capacity` without a sync).
    W/C/H: `window [B, max(W−1, 1), D]` K = V rows at slot `position % (W−1)`; `compressors` the `CompressorState`
    of the attention's (`"attention"`) and the indexer's (`"indexer"`) compressor; `entries [B, E, D]` compressed
    entries and `indexer_keys [B, E, DI]` in `E` entry slots, `⌈capacity / r⌉` rounded up to a multiple of
    `ENTRY_SLOT_MULTIPLE` (entry `j` is valid once its group is complete, `j < seqlens // r`; a decode step writes
    the new token's unfinished group there too, never seen before it is rewritten complete);
    `indexer_key_scales [B, E]` float32 with FP8 indexer keys (`for_layer`'s `fp8_indexer_keys`: e4m3 rows, key `j`
    standing for `indexer_keys[b, j] · indexer_key_scales[b, j]`), else None;
    with FP8 attention rows (`for_layer`'s `fp8_attention_rows`) `window` and `entries` are `ops.paged_rows.PagedRows`
    (e4m3 pages; the ring has `W` slots: a decode step writes the new row before its attention reads it) and
    `entry_scratch [B, 1, D]` takes each decode step's compressor entry before it is written to its page;
    M: `latent [B, capacity, kv_lora_rank + P]`, each position's normalised KV latent then its RoPE key, and
    `no_sink [H/tp]` float32 −inf, the decode attention's sink for a softmax without one (made once with the
    cache: a captured step would otherwise replay the fill every token).
    """

    kind: str
    capacity: int
    seqlens: Tensor
    window: "Optional[Tensor | PagedRows]" = None
    compressors: dict[str, CompressorState] = field(default_factory=dict)
    entries: "Optional[Tensor | PagedRows]" = None
    entry_scratch: Optional[Tensor] = None
    indexer_keys: Optional[Tensor] = None
    indexer_key_scales: Optional[Tensor] = None
    latent: Optional[Tensor] = None
    longest: int = 0
    ratio: int = 0  # the compressors' ratio r (0: none)
    no_sink: Optional[Tensor] = None
    # The layer's input projection weights stacked for its one GEMM, kept for the cache's life rather than
    # stacked again every call (`ops.stacked_projection.KeptStack`: a copy of those weights).
    stacked_weights: KeptStack = field(default_factory=KeptStack)
    # FP8 projections (`projection_precision: fp8`): each weight's e4m3 codes, rounded once for the cache's calls
    # (`layers.projection_gemms.rounded_weights_kept`; one byte per weight element).
    rounded_weights: RoundedWeights = field(default_factory=RoundedWeights)

    @classmethod
    def for_layer(cls, layer: "HybridAttention", batch: int, capacity: int, dtype: Optional[torch.dtype] = None,
                  device: Optional[torch.device] = None, fp8_indexer_keys: bool = False,
                  fp8_attention_rows: bool = False) -> "LayerCache":
        """An empty cache for `layer` (its parameters' dtype and device unless given). `fp8_indexer_keys`: a C
        layer keeps its indexer's compressed keys in e4m3 with one float32 scale per key (`amax / 448`, as
        DeepSeek's inference keeps them): 132 bytes a key instead of 256 in bf16, which the decode step's
        indexer reads in full every token, scoring them against its queries rounded to e4m3 too
        (`ops.indexer.decode_indexer_scores`; the prefill path rounds its queries the same way). Its scores then
        differ from the full forward's by that rounding (docs/user_guide.md, "Generate").

        `fp8_attention_rows` (W/C/H): the K = V rows the attention reads, window and compressed entries, in e4m3
        pages (`ops.paged_rows`: 64-column tiles with power-of-two scales, the RoPE columns in bfloat16; 584 bytes a
        row at dsv4 dims instead of 1024), the layout FlashMLA's FP8 sparse decode reads (`paged_decode_attention`).
        Every row a query attends is then rounded so, its own chunk's new rows too."""
        if batch < 1 or capacity < 1:
            raise ValueError(f"an inference cache needs batch >= 1 and capacity >= 1, got {batch}, {capacity}")
        weight = layer.linear_q_down_proj.weight
        dtype, device = dtype or weight.dtype, device or weight.device
        empty = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        c = layer.config
        cache = cls(layer.kind_spec.symbol, capacity, torch.zeros(batch, dtype=torch.long, device=device))
        if isinstance(layer.core, DenseMLACore):
            if fp8_attention_rows:
                raise ValueError("fp8_attention_rows applies to W/C/H layers (an M layer caches its latent rows)")
            cache.latent = empty(batch, capacity, c.mla_kv_lora_rank + c.qk_pos_emb_head_dim)
            cache.no_sink = torch.full((layer.local_heads,), float("-inf"), device=device)
            return cache
        paged = lambda slots: PagedRows.empty(batch, slots, c.v_head_dim, c.qk_pos_emb_head_dim, device)  # noqa: E731
        if fp8_attention_rows:
            cache.window = paged(c.csa_window_size)
        else:
            cache.window = empty(batch, max(c.csa_window_size - 1, 1), c.v_head_dim)
        attention = layer.core_attention
        for name, compressor in (("attention", attention.compressor),
                                 ("indexer", attention.indexer.compressor if attention.indexer else None)):
            if compressor is not None:
                width, slots = compressor.linear_wkv.out_features, pending_slots(compressor.ratio)
                cache.compressors[name] = CompressorState.empty(batch, slots, width, dtype, device)
        if attention.compressor is not None:
            cache.ratio = attention.ratio
            entry_slots = -(-capacity // attention.ratio)
            entry_slots += -entry_slots % ENTRY_SLOT_MULTIPLE
            if fp8_attention_rows:
                cache.entries, cache.entry_scratch = paged(entry_slots), empty(batch, 1, c.v_head_dim)
            else:
                cache.entries = empty(batch, entry_slots, c.v_head_dim)
        if attention.indexer is not None:
            cache.indexer_keys = empty(batch, entry_slots, c.dsa_indexer_head_dim)
            if fp8_indexer_keys:
                cache.indexer_keys = cache.indexer_keys.to(FP8_KEYS)
                cache.indexer_key_scales = torch.ones(batch, entry_slots, device=device)
        return cache

    @property
    def batch(self) -> int:
        return self.seqlens.shape[0]

    def nbytes(self) -> int:
        """Bytes the cache's buffers hold."""
        buffers = [self.window, self.entries, self.entry_scratch, self.indexer_keys, self.indexer_key_scales,
                   self.latent]
        buffers = [b.pages if isinstance(b, PagedRows) else b for b in buffers]
        buffers += [state.rows for state in self.compressors.values()]
        return sum(t.numel() * t.element_size() for t in buffers if t is not None)


def new_rows_layout(hidden: Tensor, cu_seqlens: Optional[Tensor], cu_seqlens_padded: Optional[Tensor],
                    max_seqlen: Optional[int], cache: LayerCache) -> TokenLayout:
    """The layout of a cached call's new rows: `[S, B, d]` appends S tokens to each of the B sequences;
    packed `[T, 1, d]` appends `diff(cu_seqlens)` tokens (0 allowed) to sequence b = segment b. Positions
    continue each sequence's cache (`position_offsets = cache.seqlens`)."""
    seqlen, batch, _ = hidden.shape
    if cu_seqlens is None:
        if batch != cache.batch:
            raise ValueError(f"hidden_states batch {batch} differs from the inference cache's batch {cache.batch}")
        layout = TokenLayout(torch.arange(0, (batch + 1) * seqlen, seqlen, device=hidden.device),
                             batch * seqlen, seqlen)
    else:
        if cu_seqlens.numel() - 1 != cache.batch:
            raise ValueError(f"packed_seq_params has {cu_seqlens.numel() - 1} sequences, the inference cache "
                             f"{cache.batch}: segment b appends to cached sequence b")
        layout = TokenLayout.packed(cu_seqlens, seqlen, hidden.device, cu_seqlens_padded, max_seqlen)
    # A copy: the cache's lengths are advanced in place after the call.
    return dataclasses.replace(layout, position_offsets=cache.seqlens.clone())


def attend_cached(layer: "HybridAttention", x: Tensor, new: TokenLayout, cache: LayerCache) -> Tensor:
    """New token rows `x [N, d]` (layout `new`) → this rank's `linear_proj` input `[N, F/tp]`, attending
    over the cached rows of their sequences and each other; the cache then holds them too."""
    check_cache_kind(layer, cache)
    longest = int((cache.seqlens + new.real_seqlens).max())  # the reference path's one host sync
    if longest > cache.capacity:
        raise ValueError(f"a sequence would reach {longest} tokens, more than the inference cache's capacity "
                         f"{cache.capacity}")
    out = (_latent_step if isinstance(layer.core, DenseMLACore) else _sparse_step)(layer, x, new, cache)
    cache.seqlens += new.real_seqlens
    cache.longest = longest
    return out


def check_cache_kind(layer: "HybridAttention", cache: LayerCache) -> None:
    if cache.kind != layer.kind_spec.symbol:
        raise ValueError(f"inference cache of a kind {cache.kind!r} layer given to a kind "
                         f"{layer.kind_spec.symbol!r} layer")


# ---------------------------------------------------------------- W / C / H
def _sparse_step(layer: "HybridAttention", x: Tensor, new: TokenLayout, cache: LayerCache) -> Tensor:
    c, attention = layer.config, layer.core_attention
    positions, inv_freq = new.positions, layer.angle_freq(x.dtype)
    q, kv, projected, qr = layer.core.project(layer, x, positions, cache.stacked_weights)
    before = cache.seqlens
    # kv_all = [new rows (N); window ring (B·R); compressed entries (B·C)]: the rows indices point into.
    ring = _slots(cache.window)
    window = _window_rows(new, before, c.csa_window_size, ring)
    kv_offset = new.num_rows + cache.batch * ring
    # Cached rows in the rows' dtype: under autocast they may differ from the cache's. An FP8 row cache's queries
    # read their own chunk's rows rounded as the cache keeps them, as a decode step reads its new row.
    seen = round_trip(kv.detach(), c.qk_pos_emb_head_dim).to(kv.dtype) if isinstance(cache.window, PagedRows) else kv
    parts = [seen, _cached_rows(cache.window, kv.dtype).flatten(0, 1)]
    selection = IndexSelection(window, None)
    if attention.compressor is not None:
        # New entries first: a row sees the entries its own chunk completes.
        _append_entries(attention.compressor, cache.compressors["attention"], projected, new, before,
                        cache.entries, inv_freq)
        entries = _visible_entries(new, (before + new.real_seqlens) // attention.ratio, _slots(cache.entries),
                                   attention.ratio)
        parts.append(_cached_rows(cache.entries, kv.dtype).flatten(0, 1))
        if attention.indexer is None:
            selection = IndexSelection(window, offset_valid(entries.rows(), kv_offset))
        else:
            indexer = attention.indexer
            _append_entries(indexer.compressor, cache.compressors["indexer"], projected, new, before,
                            cache.indexer_keys, inv_freq, cache.indexer_key_scales)
            queries, weights = indexer.queries(projected, qr.detach(), positions, inv_freq)
            keys = _stored_rows(cache.indexer_keys, cache.indexer_key_scales).flatten(0, 1).to(queries.dtype)
            if cache.indexer_key_scales is not None:  # as the decode step scores an FP8 cache: e4m3 queries too
                queries = rounded_rows(queries).to(queries.dtype)
            selection = indexer.select((queries, keys, weights), entries,
                                       c.dsa_indexer_topk, window, kv_offset)
    attention.last_selection = selection
    out, _ = sparse_attention(q, torch.cat(parts), selection.all(), attention.attn_sink, c.softmax_scale, c)
    _write_slots(cache.window, kv, new, before)  # after kv_all was built: a new row may take an old slot
    return layer.core.finish(layer, out, positions)


def _slots(buffer: "Tensor | PagedRows") -> int:
    """The slots of a cache buffer `[B, slots, D]` or of its pages."""
    return buffer.slots if isinstance(buffer, PagedRows) else buffer.shape[1]


def _cached_rows(buffer: "Tensor | PagedRows", dtype: torch.dtype) -> Tensor:
    """`[B, slots, D]` the rows a cache buffer holds in `dtype` (an FP8 one's: the values its codes stand for)."""
    return all_rows(buffer, dtype) if isinstance(buffer, PagedRows) else buffer.to(dtype)


def _window_rows(new: TokenLayout, before: Tensor, window: int, ring: int) -> Tensor:
    """`[N, W]` rows of kv_all each new row attends in its window: positions `max(0, p−W+1) … p`, new rows
    where the position is new, else the ring slot `position % ring`; −1 past `p` (as `window_indices`)."""
    seg, p = new.segment_ids, new.positions
    wanted = (p - window + 1).clamp_min(0).unsqueeze(1) + torch.arange(window, device=p.device)
    local = wanted - before[seg].unsqueeze(1)
    from_new = new.cu_seqlens[seg].unsqueeze(1) + local
    from_ring = new.num_rows + seg.unsqueeze(1) * ring + wanted % ring
    rows = torch.where(local >= 0, from_new, from_ring)
    return torch.where(wanted <= p.unsqueeze(1), rows, INVALID)


def _visible_entries(new: TokenLayout, complete: Tensor, width: int, ratio: int) -> VisibleEntries:
    """Entry `j` of sequence b is row `b·width + j` of the flattened cache, of which the first `complete[b]` are
    complete; the row at position `p` sees `j < (p + 1) // r` (ratio-causal, as the full forward's
    `visible_compressed_entries`)."""
    j = torch.arange(width, device=complete.device)
    batch = torch.arange(complete.shape[0], device=complete.device).unsqueeze(1)
    table = torch.where(j < complete.unsqueeze(1), batch * width + j, INVALID)
    seg = new.segment_ids
    count = torch.minimum(entry_counts(new.positions, ratio), complete[seg])
    return VisibleEntries(table, seg, count)


def _append_entries(compressor: Compressor, state: CompressorState, projected: dict, new: TokenLayout,
                    before: Tensor, store: "Tensor | PagedRows", inv_freq: Tensor, scales: Optional[Tensor] = None
                    ) -> None:
    """Pool the entries the new rows complete into `store [B, C, Dc]` (with `scales [B, C]`: an FP8 store,
    `encode_rows`; or FP8 attention-row pages) and keep their unfinished tokens.

    The compressor runs on one segment per sequence: its pending positions (from the first token of the
    previous group for ratio 4, else of the unfinished group), then its new rows, laid out as a piece of
    the sequence (`CompressedLayout.owned`, as a context-parallel rank computes the entries it owns)."""
    r, slots, batch = compressor.ratio, state.slots, before.shape[0]
    first_entry = torch.div(before, r, rounding_mode="floor")
    start = ((first_entry - (1 if r == OVERLAP_RATIO else 0)) * r).clamp_min(0)
    held, added = before - start, new.real_seqlens
    cu = torch.zeros(batch + 1, dtype=torch.long, device=before.device)
    cu[1:] = torch.cumsum(held + added, 0)
    num_rows = new.num_rows + batch * (slots - 1)  # held <= slots − 1: a bound known on the host
    rows = torch.arange(num_rows, device=before.device)
    seg = (torch.searchsorted(cu, rows, right=True) - 1).clamp(0, batch - 1)
    local = rows - cu[seg]
    source = torch.where(local < held[seg], new.num_rows + seg * slots + (start[seg] + local) % slots,
                         new.cu_seqlens[seg] + local - held[seg])
    source = torch.where(rows < cu[-1], source, 0)  # the tail past the last segment: any row
    tokens = TokenLayout(cu, num_rows, new.max_seqlen + slots, position_offsets=start)
    layout = CompressedLayout.owned(tokens, r, first_entry,
                                    torch.div(before + added, r, rounding_mode="floor") - first_entry,
                                    num_rows // r)
    new_rows = _new_slot_rows(compressor, projected)
    pooled = _pool(compressor, torch.cat((new_rows, state.rows.flatten(0, 1)))[source], layout, inv_freq)
    valid = layout.valid
    where = (layout.segment_ids[valid], layout.entry_index[valid])
    if isinstance(store, PagedRows):
        write_rows(store, *where, pooled[valid])
    else:
        values, row_scales = encode_rows(pooled[valid], store, scales)
        byte_view(store)[where] = byte_view(values)
        if scales is not None:
            scales[where] = row_scales
    _write_slots(state.rows, new_rows, new, before)


def _stored_rows(store: Tensor, scales: Optional[Tensor]) -> Tensor:
    """The values `store [B, C, Dc]` holds: itself, or an FP8 store's rows times their `scales [B, C]` (float32)."""
    return store if scales is None else dequantize_rows(store, scales.unsqueeze(-1))


def _write_slots(buffer: "Tensor | PagedRows", rows: Tensor, new: TokenLayout, before: Tensor) -> None:
    """Write the new real rows that stay in the ring `buffer [B, K, n]` (or its pages: the last K positions of
    their sequence) at slot `position % K`."""
    slots = _slots(buffer)
    seg, p = new.segment_ids, new.positions
    keep = new.row_valid & (p >= (before + new.real_seqlens)[seg] - slots)
    if isinstance(buffer, PagedRows):
        write_rows(buffer, seg[keep], p[keep] % slots, rows[keep])
    else:
        buffer[seg[keep], p[keep] % slots] = rows[keep].to(buffer.dtype)


# ---------------------------------------------------------------- one new token per sequence (W / C / H)
def takes_decode_step(layer: "HybridAttention", seqlen: int, packed: bool) -> bool:
    """Whether a cached call of `seqlen` tokens per sequence runs `decode_step`: one unpacked token per
    sequence (of an M layer, one whose up-projection can be absorbed: `DenseMLACore.plain_up_weight`)."""
    if seqlen != 1 or packed:
        return False
    return not isinstance(layer.core, DenseMLACore) or DenseMLACore.plain_up_weight(layer) is not None


def decode_step(layer: "HybridAttention", x: Tensor, cache: LayerCache) -> Tensor:
    """One new token per cached sequence, `x [B, d]` → this rank's `linear_proj` input `[B, F/tp]`; the cache
    then holds it too. Shapes are fixed, nothing is read back to the host and every cache write is in place,
    so the step can be captured in a CUDA graph (`DecodeGraph`)."""
    check_cache_kind(layer, cache)
    if x.shape[0] != cache.batch:
        raise ValueError(f"hidden_states batch {x.shape[0]} differs from the inference cache's batch {cache.batch}")
    if cache.longest + 1 > cache.capacity:
        raise ValueError(f"a sequence would reach {cache.longest + 1} tokens, more than the inference cache's "
                         f"capacity {cache.capacity}")
    out = (_latent_decode if isinstance(layer.core, DenseMLACore) else _sparse_decode)(layer, x, cache)
    cache.longest += 1  # the step's last write counted the tokens in (`_append`)
    return out


def _sparse_decode(layer: "HybridAttention", x: Tensor, cache: LayerCache) -> Tensor:
    c, attention = layer.config, layer.core_attention
    positions = cache.seqlens  # the new token's position in each sequence
    inv_freq = layer.angle_freq(x.dtype)
    projected, qr = layer.core.latent_rows(layer, x, cache.stacked_weights)
    paged = isinstance(cache.window, PagedRows)
    entries, picks = cache.entries if attention.compressor is not None else None, None

    def attention_rows() -> Tensor:
        """The new K = V rows `[B, D]` (FP8 pages: written into the window's ring, which has W slots, so the attention
        reads the row there); the attention compressor's entry of each one's group written."""
        kv = layer.core.kv_rows(layer, projected, positions, inv_freq)
        if paged:
            _write_paged(c, cache.window, kv, positions, 1)
        if attention.compressor is not None:
            # FP8 pages: the entry goes through the one-slot scratch row, then into its page
            store = cache.entry_scratch if paged else entries
            _decode_compress(attention.compressor, cache.compressors["attention"], projected, positions, store,
                             inv_freq)
            if paged:
                _write_paged(c, entries, store[:, 0], positions, attention.ratio)
        return kv

    def attention_inputs() -> tuple[Tensor, Tensor]:
        return attention_rows(), layer.core.project_queries(layer, qr, positions, inv_freq)

    inputs = attention_inputs
    if attention.indexer is not None:
        # int32: what cuDNN's top-k takes, so no cast runs for it
        counts = torch.empty(positions.shape, dtype=torch.int32, device=positions.device)
        _decode_compress(attention.indexer.compressor, cache.compressors["indexer"], projected, positions,
                         cache.indexer_keys, inv_freq, cache.indexer_key_scales, counts)
        scores = _indexer_scores(attention.indexer, projected, qr, positions, cache.indexer_keys,
                                 cache.indexer_key_scales, counts, inv_freq)
        # What only the attention reads, made on a side stream beside the top-k, which leaves most multiprocessors
        # idle (beside the scores, which stream the keys on all of them, it slowed the step down).
        inputs = beside(attention_inputs, x.device)
        picks = _top_entries(attention.indexer, scores, counts, c.dsa_indexer_topk)
    kv, q = inputs()
    if paged:
        family, window = OpFamily.PAGED_DECODE_ATTENTION, (cache.window,)
    else:
        kv_new = kv.to(cache.window.dtype)
        family, window = OpFamily.DECODE_ATTENTION, (kv_new, cache.window)
    attend = dispatch(family, c, device=q.device, dtype=q.dtype, heads=q.shape[1], head_dim=q.shape[2],
                      selected=picks is not None)
    out = attend(q, *window, positions, c.csa_window_size, entries, picks, attention.ratio or 1, attention.attn_sink,
                 c.softmax_scale, inv_freq)  # turned back as it is written
    # The reference path's selection names rows of a kv_all this step never builds: only the picks are kept.
    attention.last_selection, attention.last_decode_picks = None, picks
    out = layer.core.finish(layer, out, positions, turned_back=True)
    if paged:
        cache.seqlens += 1  # the step's last act, as `_append`'s
    else:
        # After the attention: the slot of position p held position p − (W − 1), still in p's window.
        _append(c, cache.window, kv_new, cache.seqlens)
    return out


def _write_paged(config: "HybridAttentionConfig", paged: PagedRows, rows: Tensor, positions: Tensor,
                 ratio: int) -> None:
    """Row b of `rows [B, D]` into slot `(positions[b] // ratio) % slots` of its FP8 page (`paged_rows_write`: one
    kernel on CUDA)."""
    write = dispatch(OpFamily.PAGED_ROWS_WRITE, config, device=rows.device, dtype=rows.dtype, head_dim=paged.dim)
    write(paged.pages, paged.slots, paged.dim, paged.rope, rows, positions, ratio)


def _latent_decode(layer: "HybridAttention", x: Tensor, cache: LayerCache) -> Tensor:
    """An M layer's decode step with its up-projection `W = [W_k; W_v]` per group absorbed (module docstring):
    the query `[W_kᵀ·q_nope | q_rope]` attends the cached `[latent | k_rope]` rows of every earlier position
    and the new one (decode attention: ring = the whole cache, window `capacity + 1`, no sink), and `W_v` maps
    the output's latent columns to each head's value. `x [B, d]` → `[B, H/tp · Dv]`."""
    c, core, positions = layer.config, layer.core, cache.seqlens
    # [B, H, qk + P], [B, R], [B, P]
    q, latent, k_rope = core.project(layer, x, positions, cache.stacked_weights)
    groups, rank = layer.local_groups, latent.shape[-1]
    w_k, w_v = DenseMLACore.plain_up_weight(layer).unflatten(0, (groups, -1)).split(
        (c.mla_qk_head_dim, c.v_head_dim), dim=1)  # [G, qk, R], [G, Dv, R]
    q_nope, q_rope = q.unflatten(1, (groups, -1)).split((c.mla_qk_head_dim, c.qk_pos_emb_head_dim), dim=-1)
    query = torch.cat((torch.einsum("bghd,gdr->bghr", q_nope, w_k.to(q.dtype)), q_rope), dim=-1).flatten(1, 2)
    rows_new = torch.cat((latent, k_rope), dim=-1).to(cache.latent.dtype)
    attend = dispatch(OpFamily.DECODE_ATTENTION, c, device=q.device, dtype=q.dtype, heads=query.shape[1],
                      head_dim=query.shape[2], selected=False)
    out = attend(query, rows_new, cache.latent, positions, cache.capacity + 1, None, None, 1, cache.no_sink,
                 core.softmax_scale(c))  # [B, H, R + P]
    _append(c, cache.latent, rows_new, cache.seqlens)
    values = torch.einsum("bghr,gvr->bghv", out[..., :rank].unflatten(1, (groups, -1)), w_v.to(out.dtype))
    return values.flatten(1)


def _append(config: "HybridAttentionConfig", buffer: Tensor, rows: Tensor, seqlens: Tensor) -> None:
    """A decode step's last write: each new row into its slot of `buffer [B, R, D]` (`seqlens % R`), then the
    lengths count the new tokens (`ops.decode_append`: one kernel on CUDA). Last, since until then `seqlens` are the
    new tokens' positions."""
    append = dispatch(OpFamily.DECODE_APPEND, config, device=buffer.device, dtype=buffer.dtype)
    append(buffer, rows, seqlens)


def _decode_compress(compressor: Compressor, state: CompressorState, projected: dict, positions: Tensor,
                     store: Tensor, inv_freq: Tensor, scales: Optional[Tensor] = None,
                     counts: Optional[Tensor] = None) -> None:
    """The new tokens (at `positions [B]`) join the compressor's pending slots, and the entry of each one's group
    is written to `store [B, C, Dc]` (`scales [B, C]`: an FP8 store), complete or not, and the entries each sees
    to `counts [B]` (`ops.decode_compressor.decode_compress`: one kernel on CUDA)."""
    rows = _new_slot_rows(compressor, projected).to(state.rows.dtype)
    write = dispatch(OpFamily.DECODE_COMPRESSOR, compressor.config, device=rows.device, dtype=rows.dtype,
                     ratio=compressor.ratio, head_dim=store.shape[-1], rotate=compressor.rotate, key_dtype=store.dtype)
    write(state.rows, rows, positions, compressor.ape, compressor.norm.weight, compressor.norm.eps, inv_freq,
          compressor.rotate, store, scales, counts)


def _new_slot_rows(compressor: Compressor, projected: dict) -> Tensor:
    """The new tokens' `[N, 2·coff·Dc]` pending-slot rows, the compressor's kv then gate projections
    (`CompressorState.rows`): a view where the gate's columns follow the kv's in the same rows (column slices
    of one stacked GEMM output, the usual case), else a copy."""
    left, right = projected[compressor.linear_wkv], projected[compressor.linear_wgate]
    if (left.stride() == right.stride() and left.stride(1) == 1 and left.dtype == right.dtype
            and left.untyped_storage().data_ptr() == right.untyped_storage().data_ptr()
            and right.data_ptr() == left.data_ptr() + left.shape[1] * left.element_size()):
        return left.as_strided((left.shape[0], left.shape[1] + right.shape[1]), left.stride())
    return torch.cat((left, right), dim=1)


def _pool(compressor: Compressor, rows: Tensor, layout: CompressedLayout, inv_freq: Tensor) -> Tensor:
    """The compressor's entries of pending-slot `rows [n, 2·coff·Dc]` (kv then gate) pooled by `layout`."""
    width = rows.shape[1] // 2
    return compressor({compressor.linear_wkv: rows[:, :width], compressor.linear_wgate: rows[:, width:]}, layout,
                      inv_freq)


def _indexer_scores(indexer: LightningIndexer, projected: dict, qr: Tensor, positions: Tensor, keys: Tensor,
                    key_scales: Optional[Tensor], counts: Tensor, inv_freq: Tensor) -> Tensor:
    """`[B, C]` float32 scores of each new token's sequence's cached compressed keys `keys [B, C, DI]` (e4m3 with
    `key_scales [B, C]`: an FP8 cache), −inf past the visible ones, the first `counts [B]` = `(p + 1) // r`."""
    queries, weights = indexer.queries(projected, qr.detach(), positions, inv_freq, scaled_weights=False)
    score = dispatch(OpFamily.DECODE_INDEXER_SCORES, indexer.config, device=keys.device, dtype=queries.dtype,
                     heads=queries.shape[1], head_dim=queries.shape[2], key_dtype=keys.dtype)
    return score(queries, keys, weights, counts, indexer.scale * indexer.head_weight_scale, key_scales)


def _top_entries(indexer: LightningIndexer, scores: Tensor, counts: Tensor, topk: int) -> Tensor:
    """`[B, min(topk, C)]` entry numbers the indexer picks from its `scores [B, C]`, as a set: in any order, the
    slots without a pick −1 or not visible (the attention reads them so; `ops.indices.topk_columns`, `ordered`)."""
    batch, width = scores.shape
    pick = dispatch(OpFamily.TOPK, indexer.config, device=scores.device, dtype=scores.dtype, topk=topk,
                    columns=width, rows=batch)
    return pick(scores, None, topk, counts=counts, ordered=False)  # the valid columns: each row's prefix of counts


# ---------------------------------------------------------------- M
def _latent_step(layer: "HybridAttention", x: Tensor, new: TokenLayout, cache: LayerCache) -> Tensor:
    core: DenseMLACore = layer.core
    q, latent, k_rope = core.project(layer, x, new.positions, cache.stacked_weights)
    seg, p, real = new.segment_ids, new.positions, new.row_valid
    cache.latent[seg[real], p[real]] = torch.cat((latent, k_rope), dim=-1)[real].to(cache.latent.dtype)
    longest, rank = int((cache.seqlens + new.real_seqlens).max()), latent.shape[-1]
    cached = cache.latent[:, :longest].to(x.dtype)
    k_nope, v = core.keys_values(layer, cached[..., :rank].flatten(0, 1))
    k_nope, v = k_nope.unflatten(0, (cache.batch, longest)), v.unflatten(0, (cache.batch, longest))
    shared = cached[..., rank:].unsqueeze(2).expand(-1, -1, layer.local_groups, -1)
    k = torch.cat((k_nope, shared), dim=-1)
    return _attend_prefix(q, k, v, seg, p, core.softmax_scale(layer.config)).flatten(1)


def _attend_prefix(q: Tensor, k: Tensor, v: Tensor, seg: Tensor, positions: Tensor, scale: float) -> Tensor:
    """Each query row `t` of `q [N, H, D]` over the keys `k [B, L, G, D]` / values `v [B, L, G, Dv]` of its
    sequence `seg[t]` at positions `<= positions[t]` → `[N, H, Dv]` (softmax in the compute dtype)."""
    compute = compute_dtype(q.dtype)
    per_group = q.shape[1] // k.shape[2]
    keys = k[seg].to(compute).repeat_interleave(per_group, dim=2)  # [N, L, H, D]
    values = v[seg].to(compute).repeat_interleave(per_group, dim=2)
    logits = torch.einsum("thd,tjhd->thj", q.to(compute), keys) * scale
    future = torch.arange(k.shape[1], device=q.device) > positions.unsqueeze(1)  # [N, L]
    weights = torch.softmax(logits.masked_fill(future.unsqueeze(1), float("-inf")), dim=-1)
    return torch.einsum("thj,tjhd->thd", weights, values).to(q.dtype)



# ---------------------------------------------------------------- a model's cache, and its size
@dataclass
class InferenceCache:
    """One `LayerCache` per attention layer of a model, for `batch` sequences of up to `capacity` tokens."""

    layers: list[LayerCache]

    @classmethod
    def for_layers(cls, layers: "list[HybridAttention]", batch: int, capacity: int,
                   dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                   fp8_indexer_keys: bool = False, fp8_attention_rows: bool = False) -> "InferenceCache":
        """`fp8_attention_rows` applies to the W/C/H layers (an M layer keeps its latent rows)."""
        return cls([LayerCache.for_layer(layer, batch, capacity, dtype, device, fp8_indexer_keys,
                                         fp8_attention_rows and not isinstance(layer.core, DenseMLACore))
                    for layer in layers])

    @property
    def seqlens(self) -> Tensor:
        """`[B]` tokens cached per sequence."""
        return self.layers[0].seqlens

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


@dataclass(frozen=True)
class CacheFootprint:
    """Cache bytes of one layer for one sequence: `per_token` more per token held, `per_sequence` fixed
    (the window ring and the compressors' unfinished groups)."""

    kind: str
    per_token: float
    per_sequence: int


def cache_footprint(config: HybridAttentionConfig, kind: str, element_size: int = 2,
                    fp8_indexer_keys: bool = False, fp8_attention_rows: bool = False) -> CacheFootprint:
    """What `LayerCache` holds for a layer of `kind` (a letter of `config.KINDS`) with `config`'s dims,
    values of `element_size` bytes (2: bf16; FP8 indexer keys: one byte a value and a float32 scale a key; FP8
    attention rows: `ops.paged_rows`' row and scale bytes, the pages' padding left out). Long sequences are dominated
    by `per_token`."""
    c, spec = config, lookup_kind(kind)
    if not isinstance(spec.core, DenseMLACore):
        ratio, indexer = spec.compress_ratio(c), spec.has_indexer(c)
        key_bytes = ((c.dsa_indexer_head_dim + 4 if fp8_indexer_keys else c.dsa_indexer_head_dim * element_size)
                     if indexer else 0)
        row_bytes = (paged_rows.row_bytes(c.v_head_dim, c.qk_pos_emb_head_dim)
                     + paged_rows.scale_bytes(c.v_head_dim, c.qk_pos_emb_head_dim)
                     if fp8_attention_rows else c.v_head_dim * element_size)
        per_token = (row_bytes + key_bytes) / ratio if ratio else 0.0
        fixed = (c.csa_window_size * row_bytes if fp8_attention_rows
                 else max(c.csa_window_size - 1, 1) * c.v_head_dim * element_size)
        if ratio:
            coff = channel_factor(ratio)  # the ratio-4 compressor's doubled channels
            widths = [coff * c.v_head_dim] + ([coff * c.dsa_indexer_head_dim] if indexer else [])
            fixed += sum(2 * pending_slots(ratio) * width for width in widths) * element_size  # kv and gate
            fixed += c.v_head_dim * element_size if fp8_attention_rows else 0  # the entry's scratch row
        return CacheFootprint(kind, per_token, fixed)
    return CacheFootprint(kind, float(dense_mla_bytes_per_token(c, element_size)), 0)


def dense_mla_bytes_per_token(config: HybridAttentionConfig, element_size: int = 2) -> int:
    """A dense MLA latent cache's bytes per token per layer: the `kv_lora_rank` latent and the RoPE key."""
    return (config.mla_kv_lora_rank + config.qk_pos_emb_head_dim) * element_size


def footprint_table(config: HybridAttentionConfig, element_size: int = 2) -> str:
    """A Markdown table of `cache_footprint` for every kind against the dense MLA latent cache."""
    dense = dense_mla_bytes_per_token(config, element_size)
    lines = ["| kind | bytes / token / layer | vs dense MLA | fixed bytes / sequence / layer |", "|---|---|---|---|"]
    for kind in KINDS:
        f = cache_footprint(config, kind, element_size)
        lines.append(f"| {kind} | {f.per_token:g} | {f.per_token / dense:.4f} | {f.per_sequence} |")
    return "\n".join(lines)
