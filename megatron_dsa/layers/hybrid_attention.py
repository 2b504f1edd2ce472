"""`HybridAttention`: the DeepSeek-V4 hybrid attention layer, one class for every kind (W / C / H / M).

Input and output are `[S, B, hidden]` (sequence first, Megatron style). The layer owns what every kind
shares (the query path and `linear_proj`); its kind's row in `layers.kinds.KINDS` gives the rest (its
core, RoPE table, compressor ratio, indexer, halo). Parameter names equal Megatron-Core's
`DSv4HybridSelfAttention` (W/C/H) and `MLASelfAttention` (M), relative to the attention module, so
checkpoints load with `strict=True`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from megatron_dsa.backends import chained_launches, check_backend_choice
from megatron_dsa.config import HybridAttentionConfig, LayerKind
from megatron_dsa.device_cache import KeptWhileUnchanged
from megatron_dsa.layers.common import HighPrecisionModule, linear, make_norm, output_init_std, project_rows
from megatron_dsa.layers.kinds import KindSpec, resolve_kind
from megatron_dsa.layers.projection_gemms import projection_gemms, rounded_weights_kept
from megatron_dsa.layers.decoding import LayerCache, attend_cached, decode_step, new_rows_layout, takes_decode_step
from megatron_dsa.layers.rows import LocalRows, TokenRows, token_rows
from megatron_dsa.layers.submodules import HybridAttentionSubmodules, apply
from megatron_dsa.ops.precision import compute_dtype
from megatron_dsa.ops.stacked_projection import KeptStack
from megatron_dsa.packed_seq import PackedSeqParams, check_packed_hidden_states, validate_packed_seq_params
from megatron_dsa.parallel.linear import divide
from megatron_dsa.parallel.mappings import gather_from_sequence_parallel_region
from megatron_dsa.parallel.state import ParallelState


class HybridAttention(HighPrecisionModule):
    """One attention layer of kind W, C, H or M.

    `HybridAttention(config, layer_number=3)` reads the kind from `config.layer_pattern`;
    `HybridAttention(config, kind="C")` picks it directly (a `layers.kinds.KindSpec` row also works).
    `parallel_state` holds the tensor- and context-parallel groups (heads split across TP ranks, the
    sequence across CP ranks; see docs/parallelism.md); None means a single process. `submodules`
    picks the classes of the parallel projections and q / kv norms (`layers.submodules`; default: the
    package's own).

    forward(hidden_states `[S, B, d]`, or `[S/tp, B, d]` under sequence parallelism) → `(output,
    bias=None)` of the same shape. In training, C layers attach the indexer KL loss to the
    backward; its coefficient-scaled value is `last_indexer_loss`.
    """

    keep_high_precision = {"rotary_inv_freq": torch.float64}  # exact RoPE tables

    def __init__(self, config: HybridAttentionConfig, layer_number: Optional[int] = None,
                 kind: Union[KindSpec, LayerKind, str, None] = None, parallel_state: Optional[ParallelState] = None,
                 submodules: Optional[HybridAttentionSubmodules] = None):
        super().__init__()
        c = self.config = config
        self.submodules = submodules or HybridAttentionSubmodules()
        check_backend_choice(c.attention_backend, c.attention_backend_overrides)
        self.kind_spec = resolve_kind(config, layer_number, kind)
        self.kind = self.kind_spec.kind
        self.core = self.kind_spec.core
        self.layer_number = layer_number
        self.parallel_state = parallel_state or ParallelState()
        self.tp_group = self.parallel_state.tp_group
        tp = self.parallel_state.tp_size
        self.local_heads = divide(c.num_attention_heads, tp, "num_attention_heads")
        self.q_head_dim = self.core.q_head_dim(c)
        self.gemms = projection_gemms(c)  # native or FP8 products (`layers.projection_gemms`)
        std = c.init_method_std
        self.linear_q_down_proj = linear(c.hidden_size, c.q_lora_rank, std)
        self.q_layernorm = self.build_norm(c.q_lora_rank)
        self.linear_q_up_proj = self.submodules.build_column(
            c.q_lora_rank, c.num_attention_heads * self.q_head_dim, self.tp_group, std, self.gemms)
        self.core.build(self)
        self.linear_proj = self.submodules.build_row(self.core.output_width(c), c.hidden_size, self.tp_group,
                                                     output_init_std(std, c.num_layers), c.sequence_parallel,
                                                     self.gemms)
        self.register_buffer("rotary_inv_freq", self.kind_spec.rope_table(c), persistent=False)
        self._kept_angle_freq: dict[torch.dtype, KeptWhileUnchanged[Tensor]] = {}  # `angle_freq`'s conversions

    def build_norm(self, dim: int) -> nn.Module:
        """`q_layernorm` / `kv_layernorm`: the submodules' norm, or ours; Identity without `qk_layernorm`."""
        c = self.config
        if c.qk_layernorm and self.submodules.norm is not None:
            return self.submodules.norm(dim, c.layernorm_epsilon)
        return make_norm(dim, c.layernorm_epsilon, c.qk_layernorm, c)

    # ---------------------------------------------------------------- forward
    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None,
                inference_cache: Optional[LayerCache] = None) -> tuple[Tensor, Optional[Tensor]]:
        """`hidden_states [S, B, d]` → `([S, B, d], None)`; packed input is `[T, 1, d]` with
        `packed_seq_params` (see `megatron_dsa.packed_seq`). Under sequence parallelism dim 0 is this
        rank's slice; under context parallelism it holds this rank's chunks of every sequence (packed:
        `packed_seq_params` describes the global pack, on the host).

        `attention_mask` (Megatron's: bool, True = masked out, `[B | 1, 1, S, S]`): None or the causal
        mask give causal attention; a mask that is causal within documents (Megatron's
        `--reset-attention-mask`) runs every document on its own, positions restarting, as packed
        input does (one host sync to read the documents); any other mask raises ValueError.

        `inference_cache` (`layers.decoding.LayerCache`, inference only): the input is new tokens of the
        cached sequences (`[S, B, d]`: S more for each; packed: `cu_seqlens_q` per sequence), attended
        over what the cache holds, which then holds them too (see `layers.decoding`). One unpacked token per
        sequence of a W, C or H layer runs the decode step (`layers.decoding.decode_step`: no host sync,
        CUDA-graph capturable)."""
        self._check_input(hidden_states)
        sp_group = self.tp_group if self.config.sequence_parallel else None
        # Every rank's gradient of the gathered input is complete (the head-parallel regions sum
        # theirs), so backward keeps the own slice instead of summing tp identical copies.
        full = gather_from_sequence_parallel_region(hidden_states, sp_group, grad_is_partial=False)
        if inference_cache is not None:
            if not isinstance(inference_cache, LayerCache):
                raise TypeError(f"inference_cache must be a LayerCache, got {type(inference_cache).__name__}")
            # FP8: weights rounded once per cache; kernels chained (one stream, no CP / SP: `_forward_cached`).
            with rounded_weights_kept(inference_cache.rounded_weights), chained_launches():
                return apply(self.linear_proj, self._forward_cached(full, attention_mask, packed_seq_params,
                                                                    inference_cache)), None
        rows = token_rows(full, attention_mask, packed_seq_params, self.parallel_state, self.config,
                          self.kind_spec.context_halo(self.config))
        latent = rows.leave(self._attend_rows(rows.enter(full), rows))
        return apply(self.linear_proj, latent), None

    def _forward_cached(self, full: Tensor, attention_mask: Optional[Tensor], packed: Optional[PackedSeqParams],
                        cache: LayerCache) -> Tensor:
        """The gathered new tokens `full` → `linear_proj`'s input, through the inference cache."""
        if attention_mask is not None:
            raise ValueError("attention_mask is not supported with inference_cache: give different prompt "
                             "lengths as packed_seq_params (one segment per cached sequence)")
        if self.parallel_state.cp_size > 1 or self.config.sequence_parallel:
            raise ValueError("inference_cache is not supported under context or sequence parallelism "
                             "(cp_size > 1, sequence_parallel): decoding feeds every rank the whole new rows")
        if takes_decode_step(self, full.shape[0], packed is not None):
            return decode_step(self, full[0], cache).unsqueeze(0)
        if packed is not None:
            check_packed_hidden_states(full)
            validate_packed_seq_params(packed, full.shape[0])
        new = new_rows_layout(full, None if packed is None else packed.cu_seqlens_q,
                              None if packed is None else packed.cu_seqlens_q_padded,
                              None if packed is None else packed.max_seqlen_q, cache)
        rows = LocalRows(new, None if packed is not None else full.shape[1])
        return rows.leave(attend_cached(self, rows.enter(full), new, cache))

    def _attend_rows(self, x: Tensor, rows: TokenRows) -> Tensor:
        """`_attend`; under `recompute_attention` in training only `x` is kept and backward runs the
        attention again (its collectives too, in the same order on every rank)."""
        if self.config.recompute_attention and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._attend, x, rows, use_reentrant=False)
        return self._attend(x, rows)

    def _attend(self, x: Tensor, rows: TokenRows) -> Tensor:
        """Token rows `x [N, d]` → this rank's `linear_proj` input `[N, F/tp]` (the kind's core)."""
        return self.core.attend(self, x, rows)

    def query_rows(self, x: Tensor, attached: Sequence[nn.Linear], detached: Sequence[nn.Linear] = (),
                   kept: Optional[KeptStack] = None) -> tuple[dict[nn.Linear, Tensor], Tensor, Tensor]:
        """The query path every kind shares, with the core's other projections of `x [N, d]` in the same
        GEMM (`project_rows`; `kept`: an inference cache's stack of their weights): `(projected, qr [N, Rq],
        q [N, H/tp, q_head_dim])`, where `projected` maps each linear to its output and `qr` is the
        normalised query latent (the indexer's input)."""
        projected, qr = self.query_latent(x, attached, detached, kept)
        return projected, qr, self.queries(qr)

    def query_latent(self, x: Tensor, attached: Sequence[nn.Linear], detached: Sequence[nn.Linear] = (),
                     kept: Optional[KeptStack] = None) -> tuple[dict[nn.Linear, Tensor], Tensor]:
        """`query_rows` up to the normalised query latent: `(projected, qr [N, Rq])`."""
        projected = project_rows(x, [self.linear_q_down_proj, *attached], detached, self.gemms, kept)
        return projected, self.q_layernorm(projected[self.linear_q_down_proj])

    def queries(self, qr: Tensor) -> Tensor:
        """The normalised query latent `qr [N, Rq]` → this rank's query heads `[N, H/tp, q_head_dim]`."""
        return apply(self.linear_q_up_proj, qr).view(-1, self.local_heads, self.q_head_dim)

    def angle_freq(self, dtype: torch.dtype) -> Tensor:
        """The RoPE frequencies in the angle dtype of `dtype` rows. The float64 table is converted once and the
        conversion kept while the table is unchanged (each call would otherwise launch a conversion kernel: three
        per forward or decode step; `device_cache.KeptWhileUnchanged`)."""
        table, angle = self.rotary_inv_freq, compute_dtype(dtype)
        if table.dtype == angle or torch.compiler.is_compiling():  # a trace keeps nothing (no dict writes)
            return table.to(angle)
        kept = self._kept_angle_freq.setdefault(angle, KeptWhileUnchanged())
        return kept.get([table], lambda: table.to(angle))

    def _check_input(self, hidden_states: Tensor) -> None:
        if not isinstance(hidden_states, Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden_states must be [S, B, hidden_size={self.config.hidden_size}], "
                             f"got {tuple(hidden_states.shape)}")
        if not hidden_states.dtype.is_floating_point:
            raise TypeError(f"hidden_states must be a floating-point tensor, got {hidden_states.dtype}")
        weight_dtype = self.linear_q_down_proj.weight.dtype
        # Under autocast the input linears cast both sides to the autocast dtype (Megatron's mixed
        # precision: fp32 master weights, bf16 activations), so any float input is fine there.
        if hidden_states.dtype != weight_dtype and not torch.is_autocast_enabled(hidden_states.device.type):
            raise TypeError(f"hidden_states dtype {hidden_states.dtype} differs from the layer's parameter "
                            f"dtype {weight_dtype}; cast one of them or run under torch.autocast")
        if hidden_states.shape[0] == 0 or hidden_states.shape[1] == 0:
            raise ValueError(f"hidden_states must have S >= 1 and B >= 1, got {tuple(hidden_states.shape)}")

    # ---------------------------------------------------------------- logging
    @property
    def last_indexer_loss(self) -> Optional[Tensor]:
        """Coefficient-scaled indexer KL loss of the last training forward (detached), or None."""
        core = getattr(self, "core_attention", None)
        return getattr(core, "last_indexer_loss", None)

    def extra_repr(self) -> str:
        return f"kind={self.kind_spec.symbol}, layer_number={self.layer_number}"


def DenseMLAttention(config: HybridAttentionConfig, layer_number: Optional[int] = None,  # noqa: N802
                     parallel_state: Optional[ParallelState] = None,
                     submodules: Optional[HybridAttentionSubmodules] = None) -> HybridAttention:
    """A kind M layer (dense MLA): `HybridAttention(config, layer_number, kind="M", ...)`, kept for code
    that named the class M layers had before the kinds became rows of `layers.kinds.KINDS`."""
    return HybridAttention(config, layer_number, LayerKind.MLA, parallel_state, submodules)
