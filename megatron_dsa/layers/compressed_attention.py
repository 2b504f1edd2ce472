"""Core attention of the W/C/H kinds: compressor, lightning indexer, sparse attention with sink.

Works on flat token rows (see `ops.layout`): `query [T, H, D]`, `kv [T, D]`, the normalised query latent
`qr [T, Rq]` and the layer input rows `x [T, d]` through the compressors' and the indexer's linears (the
layer computes those projections together with its own, see `layers.common.project_rows`). Megatron
module names are kept (`core_attention.*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from megatron_dsa.backends import OpFamily, dispatch
from megatron_dsa.backends.indexer_kl import indexer_kl_loss
from megatron_dsa.backends.dispatched_sparse_attention import sparse_attention
from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.layers.common import HighPrecisionModule, RMSNorm, linear
from megatron_dsa.layers.projection_gemms import plain_linear, projection_gemms
from megatron_dsa.ops.compressor import channel_factor
from megatron_dsa.ops.indexer_loss import reduce_indexer_loss
from megatron_dsa.ops.indices import (SelectionRows, VisibleEntries, VisibleStructure, offset_valid,
                                      small_enough_to_keep, window_indices)
from megatron_dsa.ops.layout import CompressedLayout, TokenLayout
from megatron_dsa.ops.hadamard import hadamard_transform
from megatron_dsa.ops.sparse_attention import full_normaliser
from megatron_dsa.parallel.mappings import copy_to_tensor_parallel_region
from megatron_dsa.parallel.sharding import tensor_parallel_parameter
from megatron_dsa.parallel.state import group_size

# Indexer scores held at once while selecting the top-k (256 MiB of float32).
SELECTION_CHUNK_ELEMENTS = 1 << 26

if TYPE_CHECKING:
    from megatron_dsa.layers.rows import TokenRows


class Compressor(HighPrecisionModule):
    """Gated-pooling compressor (docs/math.md §4); `ape` stays float32 under low-precision casts."""

    keep_high_precision = {"ape": torch.float32}

    def __init__(self, config: HybridAttentionConfig, head_dim: int, ratio: int, rotate: bool):
        super().__init__()
        width = channel_factor(ratio) * head_dim
        std = config.init_method_std
        self.config, self.ratio, self.rotate = config, ratio, rotate
        self.linear_wkv = linear(config.hidden_size, width, std)
        self.linear_wgate = linear(config.hidden_size, width, std)
        self.ape = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32).normal_(std=std))
        # Holds the norm's weight and eps; the compressor op applies them (its backend, its norm).
        self.norm = RMSNorm(head_dim, config.layernorm_epsilon, config)

    def projections(self) -> list[nn.Linear]:
        """The linears this compressor applies to the layer input rows (`kv`, `gate`)."""
        return [self.linear_wkv, self.linear_wgate]

    def forward(self, projected: Mapping[nn.Linear, Tensor], layout: CompressedLayout, inv_freq: Tensor) -> Tensor:
        """`projected`: the layer input rows through each linear of `projections()` (`[T, coff·Dc]` each) →
        compressed entries `[capacity, Dc]` (RoPE at `j·r`, Hadamard if `rotate`)."""
        kv, gate = projected[self.linear_wkv], projected[self.linear_wgate]
        op = dispatch(OpFamily.COMPRESSOR, self.config, device=kv.device, dtype=kv.dtype, ratio=self.ratio)
        return op(kv, gate, self.ape, self.norm.weight, self.norm.eps, layout, inv_freq, self.rotate)


class LightningIndexer(nn.Module):
    """Scores compressed entries for each query token (docs/math.md §6.1–6.2). Inputs must be detached."""

    def __init__(self, config: HybridAttentionConfig, ratio: int):
        super().__init__()
        config.check_indexer_dims()
        c = self.config = config
        self.gemms = projection_gemms(c)
        self.heads, self.head_dim = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        self.scale = self.head_dim ** -0.5  # applied once, inside the scores (docs/math.md §6.2)
        self.linear_wq_b = linear(c.q_lora_rank, self.heads * self.head_dim, c.init_method_std)
        self.linear_weights_proj = linear(c.hidden_size, self.heads, c.init_method_std)
        self.compressor = Compressor(c, self.head_dim, ratio, rotate=True)

    def projections(self) -> list[nn.Linear]:
        """The linears the indexer applies to the (detached) layer input rows."""
        return [*self.compressor.projections(), self.linear_weights_proj]

    def features(self, projected: Mapping[nn.Linear, Tensor], qr: Tensor, layout: CompressedLayout,
                 inv_freq: Tensor, gather_keys: Callable[[Tensor], Callable[[], Tensor]] = lambda k: lambda: k
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """Indexer queries `[T, HI, DI]`, keys `[Tc, DI]` and head weights `[T, HI]` from the detached layer
        input rows through `projections()` (`projected`) and the detached query latent `qr [T, Rq]`.

        `gather_keys` starts moving the locally pooled keys to the buffer the candidates index (the row
        context's `gather_entries`; the move overlaps the query path)."""
        keys = gather_keys(self.compressor(projected, layout, inv_freq))
        q, weights = self.queries(projected, qr, layout.tokens.positions, inv_freq)
        return q, keys(), weights

    def queries(self, projected: Mapping[nn.Linear, Tensor], qr: Tensor, positions: Tensor, inv_freq: Tensor,
                scaled_weights: bool = True) -> tuple[Tensor, Tensor]:
        """Indexer queries `[T, HI, DI]` (RoPE at `positions [T]`, Hadamard) and head weights `[T, HI]` of
        the detached query latent `qr [T, Rq]` and the rows through `linear_weights_proj` (`projected`). The
        weights carry the `HI^−1/2` factor unless `scaled_weights` is False: then a scoring kernel takes it with
        its scale (`head_weight_scale`), and no elementwise pass runs for it."""
        rope = dispatch(OpFamily.ROPE, self.config, device=qr.device, dtype=qr.dtype)
        wq_b = self.linear_wq_b
        q = self.gemms.linear(qr, wq_b.weight) if plain_linear(wq_b) else wq_b(qr)
        q = q.view(-1, self.heads, self.head_dim)
        q = hadamard_transform(rope(q, positions, inv_freq))
        weights = projected[self.linear_weights_proj]
        return q, weights * self.head_weight_scale if scaled_weights else weights

    @property
    def head_weight_scale(self) -> float:
        return self.heads ** -0.5

    def scores(self, features: tuple[Tensor, Tensor, Tensor], candidates: Tensor,
               visible: Optional[VisibleStructure] = None) -> Tensor:
        """Scores `[n, C]` (float32/64, −inf at invalid) of `candidates [n, C]` (rows of the keys) for
        the query rows the features hold; `visible`: the candidates' structure (uniform batch or row
        segments), if any."""
        q, k, weights = features
        op = dispatch(OpFamily.INDEXER_SCORES, self.config, device=q.device, dtype=q.dtype, heads=q.shape[1],
                      head_dim=q.shape[2], visible=visible is not None,
                      ratio=None if visible is None else visible.ratio)
        return op(q, k, weights, candidates, self.scale, visible)

    def select(self, features: tuple[Tensor, Tensor, Tensor], entries: VisibleEntries, topk: int,
               window: Tensor, kv_offset: int) -> "IndexSelection":
        """Each row's top-k visible entries (`[T, min(topk, C)]` entry numbers, −1 = none) with their scores
        (the sparse indexer loss reuses them as its student scores) and rows: the selection the attention
        reads, `window [T, W]` in front and compressed rows starting at `kv_offset` in kv_full.

        Scored in row chunks without autograd, so the `[T, C]` scores never exist at once."""
        q, k, weights = features
        parts = []
        with torch.no_grad():
            for rows in entries.row_chunks(SELECTION_CHUNK_ELEMENTS):
                candidates, uniform = entries.rows(rows), entries.uniform_rows(rows)
                scores = self.scores((q[rows], k, weights[rows]), candidates, uniform or entries.segmented_rows(rows))
                pick = dispatch(OpFamily.TOPK, self.config, device=q.device, dtype=scores.dtype, topk=topk,
                                columns=scores.shape[1])
                columns = pick(scores, entries.valid(rows, candidates), topk, uniform, entries.prefix_counts(rows))
                parts.append((columns, *self._rows(columns, scores, entries, rows, window[rows], kv_offset)))
            if not parts:  # no query rows
                columns = torch.empty(0, min(topk, entries.width), dtype=torch.long, device=q.device)
                parts.append((columns, *self._rows(columns, columns.float(), entries, slice(0, 0), window,
                                                   kv_offset)))
        # One chunk is the usual case: no concatenation copies.
        columns, entry_scores, entry_rows, compressed, combined = (
            parts[0] if len(parts) == 1 else [torch.cat(field) for field in zip(*parts)])
        return IndexSelection(window, compressed, columns, entry_rows, entry_scores, combined)

    def _rows(self, columns: Tensor, scores: Tensor, entries: VisibleEntries, rows: slice, window: Tensor,
              kv_offset: int) -> SelectionRows:
        build = dispatch(OpFamily.SELECTION_ROWS, self.config, device=columns.device, dtype=scores.dtype)
        return build(columns, scores, entries, rows, window, kv_offset)


class IndexerLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; in backward the loss receives `scale` as its gradient (docs/math.md §9).

    This is how the indexer KL loss joins the main backward without changing the main output.
    """

    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.loss_shape, ctx.loss_dtype, ctx.scale = loss.shape, loss.dtype, scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_loss = torch.full(ctx.loss_shape, ctx.scale, dtype=ctx.loss_dtype, device=grad_output.device)
        return grad_output, grad_loss, None


@dataclass
class IndexSelection:
    """KV rows each query attends: `window [T, W]` and `compressed [T, K]` (ids into `kv_full`)."""

    window: Tensor
    compressed: Optional[Tensor]
    entries: Optional[Tensor] = None  # [T, K] indexer picks as entry numbers j of the sequence (−1 none)
    entry_rows: Optional[Tensor] = None  # [T, K] the picks' rows of the compressed buffer (−1 none)
    entry_scores: Optional[Tensor] = None  # [T, K] the picks' indexer scores (−inf at −1), no autograd
    combined: Optional[Tensor] = None  # [T, W + K] window then compressed, when built together

    def all(self) -> Tensor:
        """`[T, W + K]` every KV row each query attends: the window's, then the compressed ones."""
        if self.combined is not None:
            return self.combined
        return self.window if self.compressed is None else torch.cat((self.window, self.compressed), 1)

    def rows(self, pick: Callable[[Tensor], Tensor]) -> "IndexSelection":
        """The same selection restricted to some query rows (`pick` selects rows of each tensor)."""
        keep = lambda t: None if t is None else pick(t)  # noqa: E731
        return IndexSelection(pick(self.window), keep(self.compressed), keep(self.entries),
                              keep(self.entry_rows), keep(self.entry_scores), keep(self.combined))


class CompressedSparseAttention(HighPrecisionModule):
    """Window + compressed (+ indexer top-k) sparse attention with a learnable fp32 sink."""

    keep_high_precision = {"attn_sink": torch.float32}

    def __init__(self, config: HybridAttentionConfig, ratio: int, has_indexer: bool,
                 tp_group: Optional[ProcessGroup] = None):
        super().__init__()
        c = config
        self.config, self.ratio, self.tp_group = c, ratio, tp_group
        self.attn_sink = tensor_parallel_parameter((c.num_attention_heads,), 0, tp_group, torch.nn.init.zeros_,
                                                   dtype=torch.float32, what="num_attention_heads")
        self.compressor = Compressor(c, c.v_head_dim, ratio, rotate=False) if ratio else None
        self.indexer = LightningIndexer(c, ratio) if has_indexer else None
        self.last_indexer_loss: Optional[Tensor] = None
        self.last_selection: Optional[IndexSelection] = None  # None after a decode step (layers.decoding)
        # A C layer's decode step: [B, K] entry numbers picked, in any order; the other slots −1 or not yet visible.
        self.last_decode_picks: Optional[Tensor] = None

    def projections(self) -> tuple[list[nn.Linear], list[nn.Linear]]:
        """`(attached, detached)`: the linears applied to the layer input rows, by the compressor (its
        gradient reaches the input) and by the indexer (which reads the input detached)."""
        return (self.compressor.projections() if self.compressor is not None else [],
                self.indexer.projections() if self.indexer is not None else [])

    def forward(self, query: Tensor, kv: Tensor, projected: Mapping[nn.Linear, Tensor], qr: Tensor,
                rows: "TokenRows", inv_freq: Tensor) -> Tensor:
        """`query [N, H, D]`, `kv [N, D]` (RoPE applied), the layer input rows through each linear of
        `projections()` (`projected`, `[N, n]` each) and `qr [N, Rq]` → `[N, H, D]`.

        `rows` (`layers.rows.TokenRows`) tells which compressed entries the rows see and brings them
        to the buffer their indices point into; its `outputs` are the rows this call answers for."""
        c, layout = self.config, rows.layout
        compressed_layout, entries, compressed = None, None, None
        gather = lambda pooled: rows.gather_entries(pooled, self.ratio)  # noqa: E731
        if self.compressor is not None:
            compressed_layout = rows.compressed_layout(self.ratio)
            entries = rows.visible_entries(self.ratio)
            # In flight while the window and the indexer's selection run.
            compressed = gather(self.compressor(projected, compressed_layout, inv_freq))
        window = layout.derived(("window", c.csa_window_size), lambda: window_indices(layout, c.csa_window_size))

        features = None
        if self.indexer is None:
            selection = self._every_visible_entry(layout, window, entries)
        else:
            features = self.indexer.features(projected, qr.detach(), compressed_layout, inv_freq, gather)
            # Column j is entry j of the query's sequence, in every row context.
            selection = self.indexer.select(features, entries, c.dsa_indexer_topk, window, layout.num_rows)
        # Compressed rows follow the token rows in kv_full. The shared KV rows feed this rank's heads
        # only: their gradient is summed over TP.
        kv_full = kv if compressed is None else torch.cat((kv, compressed()))
        kv_full = copy_to_tensor_parallel_region(kv_full, self.tp_group)
        self.last_selection = selection.rows(rows.outputs)

        # Forward and backward kernels are dispatched separately (counted as sparse_attention_fwd/bwd).
        out, lse = sparse_attention(query, kv_full, selection.all(), self.attn_sink, c.softmax_scale, c)

        self.last_indexer_loss = None
        if features is not None and self.training and torch.is_grad_enabled():
            loss = self._indexer_loss(query, kv_full, layout, selection, entries, features, lse,
                                      rows.real_query_count)
            self.last_indexer_loss = loss.detach()
            out = IndexerLossAutoScaler.apply(out, loss, c.indexer_loss_backward_scale)
        return out

    def _every_visible_entry(self, layout: TokenLayout, window: Tensor,
                             entries: Optional[VisibleEntries]) -> IndexSelection:
        """W layers: the window alone. H layers: the window and every visible compressed entry, which depend
        on the layout only: they are kept with it while small (as `VisibleEntries.rows` keeps its rows),
        so the layers and steps sharing a layout build them once."""
        if entries is None:
            return IndexSelection(window, None)

        def build() -> IndexSelection:
            compressed = offset_valid(entries.rows(), layout.num_rows)
            return IndexSelection(window, compressed, combined=torch.cat((window, compressed), 1))

        if small_enough_to_keep(layout.num_rows, window.shape[1] + entries.width):
            return layout.derived(("every_visible_entry", self.ratio, window.shape[1]), build)
        return build()

    def _indexer_loss(self, query: Tensor, kv_full: Tensor, layout: TokenLayout,
                      selection: IndexSelection, entries: VisibleEntries,
                      features: tuple[Tensor, Tensor, Tensor], lse: Tensor,
                      real_queries: Union[int, Tensor]) -> Tensor:
        """Coefficient-scaled KL between the indexer and the main attention (docs/math.md §8).

        The sparse loss scores only the selected entries (`[T, K]`); the dense loss scores every
        visible entry (`[T, C]`, as its definition needs). The mean divides this call's KL sum by
        `real_queries`, the real query rows of the whole batch (the row context's count: where the
        batch's rows are spread over several calls, their losses add up to the batch mean)."""
        c = self.config
        query, kv_full = query.detach(), kv_full.detach()
        sink = self.attn_sink.detach()
        student = None  # the dense loss scores every visible entry anew
        dense = not c.dsa_indexer_use_sparse_loss
        if dense:
            entry_rows = entries.rows()
            candidates = offset_valid(entry_rows, layout.num_rows)
            full_lse = full_normaliser(query, kv_full, torch.cat((selection.window, candidates), 1), sink,
                                       c.softmax_scale)
        else:
            entry_rows, candidates, student = selection.entry_rows, selection.compressed, selection.entry_scores
            full_lse = torch.logaddexp(lse.detach(), sink.to(lse.dtype))  # = the layer's real normaliser
        loss_op = dispatch(OpFamily.INDEXER_LOSS, c, device=query.device, dtype=query.dtype,
                           heads=query.shape[1], head_dim=query.shape[-1], topk=candidates.shape[1],
                           dense=dense, tp_size=group_size(self.tp_group))
        teacher = lambda scores: loss_op(scores, query, kv_full, candidates, full_lse,  # noqa: E731
                                         c.softmax_scale, self.tp_group, return_target=True)
        q, k, weights = features
        per_row = indexer_kl_loss(q, k, weights, entry_rows, teacher, self.indexer.scale,
                                  dense=dense, requested=c, student=student)
        if layout.has_padding:  # padding and context-only rows never enter the loss
            per_row = per_row * layout.query_valid
        return reduce_indexer_loss(per_row, c.dsa_indexer_loss_coeff, c.calculate_per_token_loss, real_queries)
