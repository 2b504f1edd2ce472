"""`HybridAttention`: the DeepSeek-V4 hybrid attention layer (W / C / H) and the dense MLA kind (M).

Input and output are `[S, B, hidden]` (sequence first, Megatron style). Parameter names equal
Megatron-Core's `DSv4HybridSelfAttention` (W/C/H) and `MLASelfAttention` (M), relative to the
attention module, so checkpoints load with `strict=True`.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from megatron_dsa.backends import OpFamily, check_backend_choice, dispatch
from megatron_dsa.config import HybridAttentionConfig, LayerKind, yarn_mscale
from megatron_dsa.layers.common import (HighPrecisionModule, RMSNorm, has_call_hooks, linear, make_norm,
                                       output_init_std, project_rows)
from megatron_dsa.layers.compressed_attention import CompressedSparseAttention
from megatron_dsa.layers.context_parallel import ContextParallelRows, context_halo, ring_attention
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.output_projection import grouped_output_projection
from megatron_dsa.ops.precision import compute_dtype
from megatron_dsa.ops.rope import plain_inv_freq, yarn_inv_freq
from megatron_dsa.packed_seq import PackedSeqParams, documents_from_attention_mask, validate_packed_seq_params
from megatron_dsa.layers.submodules import HybridAttentionSubmodules, apply
from megatron_dsa.parallel.linear import divide
from megatron_dsa.parallel.mappings import copy_to_tensor_parallel_region, gather_from_sequence_parallel_region
from megatron_dsa.parallel.context import ContextParallelPlan
from megatron_dsa.parallel.sharding import tensor_parallel_parameter
from megatron_dsa.parallel.state import ParallelState


def resolve_kind(config: HybridAttentionConfig, layer_number: Optional[int],
                 kind: Union[LayerKind, str, None]) -> LayerKind:
    """The layer kind from an explicit `kind` or from the config pattern at `layer_number`."""
    if kind is None and layer_number is None:
        raise ValueError("give layer_number (1-indexed, reads config.layer_pattern) or kind (W/C/H/M)")
    from_pattern = config.layer_kind(layer_number) if layer_number is not None else None
    if kind is None:
        return from_pattern
    kind = LayerKind.parse(kind)
    if from_pattern is not None and from_pattern is not kind:
        raise ValueError(f"kind {kind.value!r} conflicts with layer_pattern[{layer_number}] = "
                         f"{from_pattern.value!r}")
    return kind


def _check_packed_shape(hidden_states: Tensor) -> None:
    if hidden_states.shape[1] != 1:
        raise ValueError(f"packed (THD) hidden_states must be [T, 1, hidden], got "
                         f"{tuple(hidden_states.shape)}")


class HybridAttention(HighPrecisionModule):
    """One attention layer of kind W, C, H or M.

    `HybridAttention(config, layer_number=3)` reads the kind from `config.layer_pattern`;
    `HybridAttention(config, kind="C")` picks it directly. Kind M builds a `DenseMLAttention`
    (a subclass), so every kind is a `HybridAttention`. `parallel_state` holds the tensor-parallel
    group (heads split across ranks; see docs/parallelism.md); None means a single process. `submodules`
    picks the classes of the parallel projections and q / kv norms (`layers.submodules`; default: the
    package's own).

    forward(hidden_states `[S, B, d]`, or `[S/tp, B, d]` under sequence parallelism) → `(output,
    bias=None)` of the same shape. In training, C layers attach the indexer KL loss to the
    backward; its coefficient-scaled value is `last_indexer_loss`.
    """

    keep_high_precision = {"rotary_inv_freq": torch.float64}  # exact RoPE tables

    def __new__(cls, config: Optional[HybridAttentionConfig] = None, layer_number: Optional[int] = None,
                kind: Union[LayerKind, str, None] = None, parallel_state: Optional[ParallelState] = None,
                submodules: Optional[HybridAttentionSubmodules] = None):
        # `config` is optional here only so copy/pickle (which call __new__ without arguments) work.
        if (cls is HybridAttention and config is not None
                and resolve_kind(config, layer_number, kind) is LayerKind.MLA):
            cls = DenseMLAttention
        return super().__new__(cls)

    def __init__(self, config: HybridAttentionConfig, layer_number: Optional[int] = None,
                 kind: Union[LayerKind, str, None] = None, parallel_state: Optional[ParallelState] = None,
                 submodules: Optional[HybridAttentionSubmodules] = None):
        super().__init__()
        c = self.config = config
        self.submodules = submodules or HybridAttentionSubmodules()
        check_backend_choice(c.attention_backend, c.attention_backend_overrides)
        self.kind = resolve_kind(config, layer_number, kind)
        self.layer_number = layer_number
        self.parallel_state = parallel_state or ParallelState()
        self.tp_group = self.parallel_state.tp_group
        tp = self.parallel_state.tp_size
        self.local_heads = divide(c.num_attention_heads, tp, "num_attention_heads")
        std = c.init_method_std
        self.linear_q_down_proj = linear(c.hidden_size, c.q_lora_rank, std)
        self.q_layernorm = self._norm(c.q_lora_rank)
        self.linear_q_up_proj = self.submodules.build_column(
            c.q_lora_rank, c.num_attention_heads * self._q_head_dim(), self.tp_group, std)
        self._build_kv_path()
        self.linear_proj = self.submodules.build_row(self._proj_in_features(), c.hidden_size, self.tp_group,
                                                     output_init_std(std, c.num_layers), c.sequence_parallel)
        self.register_buffer("rotary_inv_freq", self._inv_freq(), persistent=False)

    # ---------------------------------------------------------------- W / C / H structure
    def _q_head_dim(self) -> int:
        return self.config.v_head_dim

    def _build_kv_path(self) -> None:
        c = self.config
        self.local_groups = divide(c.o_groups, self.parallel_state.tp_size, "o_groups")
        self.linear_kv_proj = linear(c.hidden_size, c.v_head_dim, c.init_method_std)
        self.kv_layernorm = self._norm(c.v_head_dim)
        group_width = c.num_attention_heads * c.v_head_dim // c.o_groups
        self.linear_o_group_proj = tensor_parallel_parameter(
            (c.o_groups * c.o_lora_rank, group_width), 0, self.tp_group,
            lambda w: w.normal_(std=c.init_method_std), what="o_groups · o_lora_rank")
        self.core_attention = CompressedSparseAttention(c, self.kind, self.tp_group)

    def _proj_in_features(self) -> int:
        return self.config.o_groups * self.config.o_lora_rank

    def _norm(self, dim: int) -> nn.Module:
        """`q_layernorm` / `kv_layernorm`: the submodules' norm, or ours; Identity without `qk_layernorm`."""
        c = self.config
        if c.qk_layernorm and self.submodules.norm is not None:
            return self.submodules.norm(dim, c.layernorm_epsilon)
        return make_norm(dim, c.layernorm_epsilon, c.qk_layernorm, c)

    def _inv_freq(self) -> Tensor:
        """W: plain RoPE at `rotary_base`; C/H: YaRN at `csa_compress_rotary_base` (spec §1.3)."""
        c = self.config
        if self.kind is LayerKind.WINDOW:
            return plain_inv_freq(c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_percent)
        return yarn_inv_freq(c.qk_pos_emb_head_dim, c.csa_compress_rotary_base, c.rotary_scaling_factor,
                             c.original_max_position_embeddings, c.beta_fast, c.beta_slow)

    # ---------------------------------------------------------------- forward
    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> tuple[Tensor, Optional[Tensor]]:
        """`hidden_states [S, B, d]` → `([S, B, d], None)`; packed input is `[T, 1, d]` with
        `packed_seq_params` (see `megatron_dsa.packed_seq`). Under sequence parallelism dim 0 is this
        rank's slice.

        `attention_mask` (Megatron's: bool, True = masked out, `[B | 1, 1, S, S]`): None or the causal
        mask give causal attention; a mask that is causal within documents (Megatron's
        `--reset-attention-mask`) runs every document on its own, positions restarting, as packed
        input does (one host sync to read the documents); any other mask raises ValueError."""
        self._check_input(hidden_states)
        sp_group = self.tp_group if self.config.sequence_parallel else None
        # Every rank's gradient of the gathered input is complete (the head-parallel regions sum
        # theirs), so backward keeps the own slice instead of summing tp identical copies.
        full = gather_from_sequence_parallel_region(hidden_states, sp_group, grad_is_partial=False)
        documents = self._documents(attention_mask, full, packed_seq_params)
        if self.parallel_state.cp_size > 1:
            return self._project_out(self._context_parallel_latent(full, packed_seq_params)), None
        seqlen, batch, _ = full.shape
        if packed_seq_params is None:
            layout = (TokenLayout.uniform(batch, seqlen, full.device) if documents is None
                      else TokenLayout.packed(documents, batch * seqlen, full.device))
            rows = full.transpose(0, 1).reshape(batch * seqlen, -1)  # batch-major token rows
            latent = self._attend_rows(rows, layout).view(batch, seqlen, -1).transpose(0, 1)
        else:
            layout = self._packed_layout(full, packed_seq_params)
            # Padding and tail rows (possibly NaN-filled) are zeroed on the way in and on the way
            # out of the attention: nothing non-finite reaches a product, their outputs are exactly
            # 0 (no bias) and their input gradients exactly 0.
            real = layout.row_valid.unsqueeze(1)
            rows = torch.where(real, full[:, 0], 0.0)
            latent = torch.where(real, self._attend_rows(rows, layout), 0.0).unsqueeze(1)
        return self._project_out(latent), None

    def _project_out(self, latent: Tensor) -> Tensor:
        return apply(self.linear_proj, latent)

    def _documents(self, attention_mask: Optional[Tensor], full: Tensor,
                   packed: Optional[PackedSeqParams]) -> Optional[Tensor]:
        """`cu_seqlens` of the documents a document mask keeps apart (batch-major rows), or None."""
        if attention_mask is None:
            return None
        if packed is not None:
            raise ValueError("give attention_mask or packed_seq_params, not both: packed input takes its "
                             "documents from packed_seq_params.cu_seqlens_q")
        state = self.parallel_state
        documents = documents_from_attention_mask(attention_mask, full.shape[1], full.shape[0] * state.cp_size)
        if documents is not None and state.cp_size > 1:
            raise ValueError("a document attention_mask is not supported under context parallelism: pass the "
                             "documents as packed_seq_params (THD, host cu_seqlens_q) instead")
        return documents

    def _context_parallel_latent(self, full: Tensor, packed: Optional[PackedSeqParams]) -> Tensor:
        """This rank's pieces of every sequence → its `linear_proj` input, same row order as `full`.

        SBHD `[S/cp, B, d]` holds the rank's chunks along S; packed `[T/cp, 1, d]` its chunks of every
        sequence (`packed` describes the global pack, on the host; see `parallel.context`)."""
        state, c = self.parallel_state, self.config
        plan, rows, to_output = self._context_parallel_rows(full, packed)
        ratio = c.compress_ratio(self.kind)
        halo = 0 if self.kind is LayerKind.MLA else context_halo(c.csa_window_size, ratio)
        cp = ContextParallelRows(plan, state.cp_rank, state.cp_group, halo, full.device, c.cp_comm_type)
        extended = cp.extend(rows) if halo else rows
        real = cp.layout.row_valid.unsqueeze(1)
        latent = self._attend_rows(torch.where(real, extended, 0.0), cp.layout, cp)
        latent = torch.where(cp.layout.query_valid.unsqueeze(1), latent, 0.0)
        return to_output(cp.outputs(latent) if halo else latent)

    def _context_parallel_rows(self, full: Tensor, packed: Optional[PackedSeqParams]):
        """`(plan, local rows [N, d] in plan order, rows → output-shaped tensor)`."""
        state, c = self.parallel_state, self.config
        if packed is None:
            local, batch, _ = full.shape
            plan = ContextParallelPlan.build([local * state.cp_size] * batch, state.cp_size, c.cp_partition)
            rows = full.transpose(0, 1).reshape(batch * local, -1)
            return plan, rows, lambda out: out.view(batch, local, -1).transpose(0, 1)
        _check_packed_shape(full)
        cu = packed.cu_seqlens_q
        if cu.device.type != "cpu":
            raise ValueError("context parallelism with packed input needs packed_seq_params.cu_seqlens_q "
                             "(and cu_seqlens_q_padded) on the host: the partition plan is host metadata")
        padded = cu if packed.cu_seqlens_q_padded is None else packed.cu_seqlens_q_padded
        lengths = (padded[1:] - padded[:-1]).tolist()
        real = (cu[1:] - cu[:-1]).tolist()
        plan = ContextParallelPlan.build(lengths, state.cp_size, c.cp_partition, real)
        if full.shape[0] != plan.local_rows(state.cp_rank):
            raise ValueError(f"packed hidden_states has {full.shape[0]} rows but this CP rank holds "
                             f"{plan.local_rows(state.cp_rank)} (its chunks of every padded sequence)")
        return plan, full[:, 0], lambda out: out.unsqueeze(1)

    def _packed_layout(self, hidden_states: Tensor, params: PackedSeqParams) -> TokenLayout:
        _check_packed_shape(hidden_states)
        validate_packed_seq_params(params, hidden_states.shape[0])
        return TokenLayout.packed(params.cu_seqlens_q, hidden_states.shape[0], hidden_states.device,
                                  params.cu_seqlens_q_padded, params.max_seqlen_q)

    def _attend_rows(self, x: Tensor, layout: TokenLayout, cp: Optional[ContextParallelRows] = None) -> Tensor:
        """`_attend`; under `recompute_attention` in training only `x` is kept and backward runs the
        attention again (its collectives too, in the same order on every rank)."""
        if self.config.recompute_attention and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._attend, x, layout, cp, use_reentrant=False)
        return self._attend(x, layout, cp)

    def _attend(self, x: Tensor, layout: TokenLayout, cp: Optional[ContextParallelRows] = None) -> Tensor:
        """Token rows `x [T, d]` → this rank's grouped-projected attention output `[T, G/tp·Ro]`."""
        c = self.config
        positions, inv_freq = layout.positions, self._angle_freq(x.dtype)
        rope = dispatch(OpFamily.ROPE, c, device=x.device, dtype=x.dtype)
        norm_rope = dispatch(OpFamily.NORM_ROPE, c, device=x.device, dtype=x.dtype)
        core_attached, core_detached = self.core_attention.projections()
        projected = project_rows(x, [self.linear_q_down_proj, self.linear_kv_proj, *core_attached], core_detached)
        qr = self.q_layernorm(projected[self.linear_q_down_proj])  # [T, Rq], also the indexer's input
        q = apply(self.linear_q_up_proj, qr).view(-1, self.local_heads, c.v_head_dim)
        q = norm_rope(q, positions, inv_freq, c.layernorm_epsilon)  # weightless per-head RMSNorm, then RoPE
        kv = self._kv_rows(projected[self.linear_kv_proj], positions, inv_freq, rope, norm_rope)  # K = V, [T, D]
        o = self.core_attention(q, kv, projected, qr, layout, inv_freq, cp)
        o = rope(o, positions, inv_freq, inverse=True)  # relative positions in V; new storage
        return grouped_output_projection(o.flatten(1), self.linear_o_group_proj, self.local_groups)

    def _kv_rows(self, latent: Tensor, positions: Tensor, inv_freq: Tensor, rope: Callable[..., Tensor],
                 norm_rope: Callable[..., Tensor]) -> Tensor:
        """`latent [T, D]` → K = V rows: `kv_layernorm` (its weight and eps) then RoPE, as one `norm_rope`
        call when the norm is on (one fused kernel instead of two), else RoPE alone. A norm with hooks
        is called as a module, so its hooks run."""
        norm = self.kv_layernorm
        if isinstance(norm, RMSNorm) and not has_call_hooks(norm):
            return norm_rope(latent, positions, inv_freq, norm.eps, norm.weight)
        return rope(norm(latent), positions, inv_freq)

    def _angle_freq(self, dtype: torch.dtype) -> Tensor:
        """The RoPE frequencies in the angle dtype of `dtype` rows, converted once per forward (each RoPE
        op would otherwise convert the float64 table again: one kernel per call)."""
        return self.rotary_inv_freq.to(compute_dtype(dtype))

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
        return f"kind={self.kind.value}, layer_number={self.layer_number}"


class DenseMLAttention(HybridAttention):
    """Kind M: DeepSeek-V3-style dense causal multi-latent attention.

    q: low rank (`linear_q_down_proj` → `q_layernorm` → `linear_q_up_proj`) to `[H, qk + P]`.
    kv: `linear_kv_down_proj` → `[kv_lora_rank + P]`; the latent is normalised (`kv_layernorm`) and
    up-projected (`linear_kv_up_proj`) to `[G, qk + Dv]`; the last P dims are one RoPE key shared by
    all heads. Softmax scale `mscale(s, mscale_all_dim)² / sqrt(qk + P)` under YaRN.
    """

    def _q_head_dim(self) -> int:
        return self.config.mla_qk_head_dim + self.config.qk_pos_emb_head_dim

    def _build_kv_path(self) -> None:
        c = self.config
        rank, rope_dim = c.mla_kv_lora_rank, c.qk_pos_emb_head_dim
        self.local_groups = divide(c.mla_num_query_groups, self.parallel_state.tp_size, "num_query_groups")
        self.linear_kv_down_proj = linear(c.hidden_size, rank + rope_dim, c.init_method_std)
        self.kv_layernorm = self._norm(rank)
        self.linear_kv_up_proj = self.submodules.build_column(
            rank, c.mla_num_query_groups * (c.mla_qk_head_dim + c.v_head_dim), self.tp_group, c.init_method_std)

    def _proj_in_features(self) -> int:
        return self.config.num_attention_heads * self.config.v_head_dim

    def _inv_freq(self) -> Tensor:
        c = self.config
        if c.rope_type == "rope":
            return plain_inv_freq(c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_percent)
        return yarn_inv_freq(c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_scaling_factor,
                             c.original_max_position_embeddings, c.beta_fast, c.beta_slow)

    @property
    def rope_amplitude(self) -> float:
        """YaRN cos/sin magnitude `mscale(s, mscale) / mscale(s, mscale_all_dim)` (1 for plain RoPE)."""
        c = self.config
        if c.rope_type == "rope":
            return 1.0
        return yarn_mscale(c.rotary_scaling_factor, c.mscale) / yarn_mscale(c.rotary_scaling_factor,
                                                                             c.mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        c = self.config
        scale = self._q_head_dim() ** -0.5
        if c.rope_type == "yarn":
            scale *= yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim) ** 2
        return scale

    def _attend(self, x: Tensor, layout: TokenLayout, cp: Optional[ContextParallelRows] = None) -> Tensor:
        c = self.config
        heads, groups = self.local_heads, self.local_groups
        nope, rope_dim, rank = c.mla_qk_head_dim, c.qk_pos_emb_head_dim, c.mla_kv_lora_rank
        rope = dispatch(OpFamily.ROPE, c, device=x.device, dtype=x.dtype)
        positions, inv_freq, amplitude = layout.positions, self._angle_freq(x.dtype), self.rope_amplitude

        projected = project_rows(x, [self.linear_q_down_proj, self.linear_kv_down_proj])
        q = apply(self.linear_q_up_proj, self.q_layernorm(projected[self.linear_q_down_proj]))
        q = rope(q.view(-1, heads, nope + rope_dim), positions, inv_freq, amplitude=amplitude)
        latent, k_rope = projected[self.linear_kv_down_proj].split((rank, rope_dim), dim=-1)
        kv = apply(self.linear_kv_up_proj, self.kv_layernorm(latent)).view(-1, groups, nope + c.v_head_dim)
        k_nope, v = kv.split((nope, c.v_head_dim), dim=-1)
        # One RoPE key shared by all heads; this rank's heads give part of its gradient.
        k_rope = copy_to_tensor_parallel_region(rope(k_rope, positions, inv_freq, amplitude=amplitude),
                                                self.tp_group)
        k = torch.cat((k_nope, k_rope.unsqueeze(1).expand(-1, groups, -1)), dim=-1)
        if cp is not None:
            out = ring_attention(q, k, v, cp.plan, cp.rank, cp.group, self.softmax_scale, c.cp_comm_type)
            return out.flatten(1)
        attend = dispatch(OpFamily.DENSE_ATTENTION, c, device=x.device, dtype=x.dtype,
                          head_dim=nope + rope_dim, v_head_dim=c.v_head_dim, heads=heads, groups=groups,
                          layout=layout, lse_grad=False)  # the layer uses only `out`
        out, _ = attend(q, k, v, layout, self.softmax_scale)
        return out.flatten(1)
