"""The two cores a layer kind is built around: what a kind adds to the layer's shared query path.

Every kind shares the query path (`linear_q_down_proj` → `q_layernorm` → `linear_q_up_proj`) and the
output projection `linear_proj`, which `HybridAttention` owns. A core adds the rest: the key/value
path and the attention, as modules it registers on the layer under Megatron's names (so checkpoints
keep their keys), and the computation from the layer's input rows to `linear_proj`'s input.

* `SparseMLACore` (W / C / H): one K = V latent head, `CompressedSparseAttention` over the window, the
  kind's compressed entries and a learnable sink, inverse RoPE, grouped output projection.
* `DenseMLACore` (M): DeepSeek-V3 dense causal multi-latent attention.

Cores are stateless: one instance serves every layer of its kinds (`layers.kinds.KINDS`). They ask
the row context (`layers.rows.TokenRows`) where the rows' keys and compressed entries come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_dsa.backends import OpFamily, dispatch
from megatron_dsa.config import HybridAttentionConfig, yarn_mscale
from megatron_dsa.layers.common import RMSNorm, has_call_hooks, linear
from megatron_dsa.layers.compressed_attention import CompressedSparseAttention
from megatron_dsa.layers.context_parallel import PackedKeyValues, RingKeys
from megatron_dsa.layers.submodules import apply
from megatron_dsa.ops.stacked_projection import KeptStack
from megatron_dsa.parallel.linear import ColumnParallelLinear, divide
from megatron_dsa.parallel.mappings import copy_to_tensor_parallel_region
from megatron_dsa.parallel.sharding import tensor_parallel_parameter

if TYPE_CHECKING:
    from megatron_dsa.layers.hybrid_attention import HybridAttention
    from megatron_dsa.layers.rows import TokenRows


class AttentionCore(Protocol):
    """A kind's key/value path and attention (see the module docstring)."""

    def q_head_dim(self, config: HybridAttentionConfig) -> int:
        """Width of each query head out of `linear_q_up_proj`."""

    def output_width(self, config: HybridAttentionConfig) -> int:
        """Input features of `linear_proj` (all ranks together)."""

    def build(self, layer: "HybridAttention") -> None:
        """Registers the core's modules on `layer` (between `linear_q_up_proj` and `linear_proj`)."""

    def attend(self, layer: "HybridAttention", x: Tensor, rows: "TokenRows") -> Tensor:
        """Token rows `x [N, d]` → this rank's `linear_proj` input `[N, output_width / tp]`."""


class SparseMLACore:
    """W / C / H: window + compressed (+ indexer top-k) sparse attention with a sink (docs/architecture.md §2)."""

    def q_head_dim(self, config: HybridAttentionConfig) -> int:
        return config.v_head_dim

    def output_width(self, config: HybridAttentionConfig) -> int:
        return config.o_groups * config.o_lora_rank

    def build(self, layer: "HybridAttention") -> None:
        c, spec = layer.config, layer.kind_spec
        layer.local_groups = divide(c.o_groups, layer.parallel_state.tp_size, "o_groups")
        layer.linear_kv_proj = linear(c.hidden_size, c.v_head_dim, c.init_method_std)
        layer.kv_layernorm = layer.build_norm(c.v_head_dim)
        group_width = c.num_attention_heads * c.v_head_dim // c.o_groups
        layer.linear_o_group_proj = tensor_parallel_parameter(
            (c.o_groups * c.o_lora_rank, group_width), 0, layer.tp_group,
            lambda w: w.normal_(std=c.init_method_std), what="o_groups · o_lora_rank")
        ratio, indexer = spec.compress_ratio(c), spec.has_indexer(c)
        if indexer and not ratio:
            raise ValueError(f"kind {spec.symbol!r} has an indexer but no compressor (ratio 0): the indexer "
                             f"scores compressed entries")
        layer.core_attention = CompressedSparseAttention(c, ratio, indexer, layer.tp_group)

    def attend(self, layer: "HybridAttention", x: Tensor, rows: "TokenRows") -> Tensor:
        positions = rows.layout.positions
        q, kv, projected, qr = self.project(layer, x, positions)
        o = layer.core_attention(q, kv, projected, qr, rows, layer.angle_freq(x.dtype))
        return self.finish(layer, o, positions)

    def project(self, layer: "HybridAttention", x: Tensor, positions: Tensor, kept: Optional[KeptStack] = None
                ) -> tuple[Tensor, Tensor, dict[nn.Linear, Tensor], Tensor]:
        """Token rows `x [N, d]` at `positions [N]` → `(q [N, H/tp, D], kv [N, D], projected, qr [N, Rq])`:
        the queries and K = V rows (normalised, RoPE applied), the rows through the compressors' and the
        indexer's linears, and the normalised query latent: all that attending the rows needs from them,
        wherever their keys are later read from. `kept`: an inference cache's stack of the input projections'
        weights (`HybridAttention.query_rows`)."""
        projected, qr = self.latent_rows(layer, x, kept)
        inv_freq = layer.angle_freq(x.dtype)
        q = self.project_queries(layer, qr, positions, inv_freq)
        return q, self.kv_rows(layer, projected, positions, inv_freq), projected, qr

    @staticmethod
    def latent_rows(layer: "HybridAttention", x: Tensor, kept: Optional[KeptStack] = None
                    ) -> tuple[dict[nn.Linear, Tensor], Tensor]:
        """`project`'s input projections: `(projected, qr [N, Rq])` (`HybridAttention.query_latent`)."""
        core_attached, core_detached = layer.core_attention.projections()
        return layer.query_latent(x, [layer.linear_kv_proj, *core_attached], core_detached, kept)

    @staticmethod
    def project_queries(layer: "HybridAttention", qr: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
        """The normalised query latent `qr [N, Rq]` → the queries `[N, H/tp, D]` (weightless per-head RMSNorm, then
        RoPE at `inv_freq`, `HybridAttention.angle_freq`)."""
        c = layer.config
        norm_rope = dispatch(OpFamily.NORM_ROPE, c, device=qr.device, dtype=qr.dtype)
        return norm_rope(layer.queries(qr), positions, inv_freq, c.layernorm_epsilon)

    @staticmethod
    def kv_rows(layer: "HybridAttention", projected: dict[nn.Linear, Tensor], positions: Tensor, inv_freq: Tensor
                ) -> Tensor:
        """The K = V rows `[N, D]` (`kv_layernorm`, then RoPE at `inv_freq`) of `linear_kv_proj`'s output in
        `projected`."""
        latent, c = projected[layer.linear_kv_proj], layer.config
        return _kv_rows(layer.kv_layernorm, latent, positions, inv_freq,
                        dispatch(OpFamily.ROPE, c, device=latent.device, dtype=latent.dtype),
                        dispatch(OpFamily.NORM_ROPE, c, device=latent.device, dtype=latent.dtype))

    def finish(self, layer: "HybridAttention", o: Tensor, positions: Tensor, turned_back: bool = False) -> Tensor:
        """Attention output `o [N, H/tp, D]` → this rank's `linear_proj` input: inverse RoPE (unless the attention
        `turned_back` its RoPE columns already: a decode step's), grouped projection."""
        if not turned_back:
            rope = dispatch(OpFamily.ROPE, layer.config, device=o.device, dtype=o.dtype)
            o = rope(o, positions, layer.angle_freq(o.dtype), inverse=True)  # relative positions in V; new storage
        return layer.gemms.grouped(o.flatten(1), layer.linear_o_group_proj, layer.local_groups)


def _kv_rows(norm: nn.Module, latent: Tensor, positions: Tensor, inv_freq: Tensor, rope: Callable[..., Tensor],
             norm_rope: Callable[..., Tensor]) -> Tensor:
    """`latent [N, D]` → K = V rows: `kv_layernorm` (its weight and eps) then RoPE, as one `norm_rope`
    call when the norm is on (one fused kernel instead of two), else RoPE alone. A norm with hooks is
    called as a module, so its hooks run."""
    if isinstance(norm, RMSNorm) and not has_call_hooks(norm):
        return norm_rope(latent, positions, inv_freq, norm.eps, norm.weight)
    return rope(norm(latent), positions, inv_freq)


class DenseMLACore:
    """M: DeepSeek-V3-style dense causal multi-latent attention (docs/architecture.md §3).

    q: low rank (`linear_q_down_proj` → `q_layernorm` → `linear_q_up_proj`) to `[H, qk + P]`.
    kv: `linear_kv_down_proj` → `[kv_lora_rank + P]`; the latent is normalised (`kv_layernorm`) and
    up-projected (`linear_kv_up_proj`) to `[G, qk + Dv]`; the last P dims are one RoPE key shared by
    all heads. Softmax scale `mscale(s, mscale_all_dim)² / sqrt(qk + P)` under YaRN.
    """

    def q_head_dim(self, config: HybridAttentionConfig) -> int:
        return config.mla_qk_head_dim + config.qk_pos_emb_head_dim

    def output_width(self, config: HybridAttentionConfig) -> int:
        return config.num_attention_heads * config.v_head_dim

    def build(self, layer: "HybridAttention") -> None:
        c = layer.config
        rank, rope_dim = c.mla_kv_lora_rank, c.qk_pos_emb_head_dim
        layer.local_groups = divide(c.mla_num_query_groups, layer.parallel_state.tp_size, "num_query_groups")
        layer.linear_kv_down_proj = linear(c.hidden_size, rank + rope_dim, c.init_method_std)
        layer.kv_layernorm = layer.build_norm(rank)
        layer.linear_kv_up_proj = layer.submodules.build_column(
            rank, c.mla_num_query_groups * (c.mla_qk_head_dim + c.v_head_dim), layer.tp_group, c.init_method_std,
            layer.gemms)

    @staticmethod
    def rope_amplitude(config: HybridAttentionConfig) -> float:
        """YaRN cos/sin magnitude `mscale(s, mscale) / mscale(s, mscale_all_dim)` (1 for plain RoPE)."""
        c = config
        if c.rope_type == "rope":
            return 1.0
        return yarn_mscale(c.rotary_scaling_factor, c.mscale) / yarn_mscale(c.rotary_scaling_factor,
                                                                             c.mscale_all_dim)

    def softmax_scale(self, config: HybridAttentionConfig) -> float:
        c = config
        scale = self.q_head_dim(c) ** -0.5
        if c.rope_type == "yarn":
            scale *= yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim) ** 2
        return scale

    def attend(self, layer: "HybridAttention", x: Tensor, rows: "TokenRows") -> Tensor:
        c = layer.config
        q, latent, k_rope = self.project(layer, x, rows.layout.positions)
        keys = LatentKeyValues(layer, self.up_projection(layer), latent, k_rope)
        return rows.attend_causal(q, keys, self.softmax_scale(c), c).flatten(1)

    @staticmethod
    def up_projection(layer: "HybridAttention") -> "LatentUpProjection":
        c = layer.config
        return LatentUpProjection(layer.local_groups, c.mla_qk_head_dim, c.v_head_dim)

    def project(self, layer: "HybridAttention", x: Tensor, positions: Tensor, kept: Optional[KeptStack] = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """Token rows `x [N, d]` at `positions [N]` → `(q [N, H/tp, qk + P]` (RoPE applied), the normalised
        KV latent `[N, kv_lora_rank]`, the shared RoPE key `[N, P]`)`: the keys and values of the rows
        follow from the latent and the RoPE key alone. `kept`: as `SparseCore.project`'s."""
        c = layer.config
        rope = dispatch(OpFamily.ROPE, c, device=x.device, dtype=x.dtype)
        inv_freq, amplitude = layer.angle_freq(x.dtype), self.rope_amplitude(c)
        projected, _, q = layer.query_rows(x, [layer.linear_kv_down_proj], kept=kept)
        q = rope(q, positions, inv_freq, amplitude=amplitude)
        latent, k_rope = projected[layer.linear_kv_down_proj].split((c.mla_kv_lora_rank, c.qk_pos_emb_head_dim),
                                                                    dim=-1)
        return q, layer.kv_layernorm(latent), rope(k_rope, positions, inv_freq, amplitude=amplitude)

    def keys_values(self, layer: "HybridAttention", latent: Tensor) -> tuple[Tensor, Tensor]:
        """Normalised latent rows `[N, kv_lora_rank]` → `(k_nope [N, G/tp, qk], v [N, G/tp, Dv])`."""
        return self.up_projection(layer).split(apply(layer.linear_kv_up_proj, latent))

    @staticmethod
    def plain_up_weight(layer: "HybridAttention") -> Optional[Tensor]:
        """`linear_kv_up_proj`'s local weight `W [G/tp·(qk + Dv), kv_lora_rank]` when the up-projection is
        `latent · Wᵀ` and nothing else: the package's own column-parallel linear, without hooks. Another class
        may own its forward (FP8 casts) and its weight gradient (Megatron and Transformer Engine add it into
        `main_grad` and fire hooks), and our FP8 product (`projection_precision: fp8`) is not a plain product:
        then None, and the keys and values come from calling the module."""
        projection = layer.linear_kv_up_proj
        if (type(projection) is not ColumnParallelLinear or has_call_hooks(projection)
                or projection.matmul is not F.linear):
            return None
        return projection.weight


@dataclass(frozen=True)
class LatentUpProjection:
    """An M layer's keys and values from the rows `[n, R + P]` that make them (normalised KV latent | shared
    RoPE key) through `linear_kv_up_proj`'s local weight `W [G·(qk + Dv), R]`: `[k_nope | v] = latent · Wᵀ`
    per group, and the one RoPE key appended to every group's `k_nope`. `R + P` numbers per token instead of
    `G·(qk + P + Dv)`: what the context-parallel ring carries (its `KeyExpansion`, `layers.context_parallel`)."""

    groups: int
    qk_head_dim: int  # the un-rotated key dims of a group
    v_head_dim: int

    def split(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Up-projected rows `[n, G·(qk + Dv)]` → `(k_nope [n, G, qk], v [n, G, Dv])`."""
        return kv.unflatten(1, (self.groups, -1)).split((self.qk_head_dim, self.v_head_dim), dim=-1)

    def with_rope(self, k_nope: Tensor, rope: Tensor) -> Tensor:
        """`k_nope [n, G, qk]` and the shared RoPE key `[n, P]` → a new `k [n, G, qk + P]` (no autograd: see
        `keys_values_of`)."""
        return _joined(k_nope, rope.unsqueeze(1), torch.promote_types(k_nope.dtype, rope.dtype))  # as cat's

    def keys_values_of(self, kv: Tensor, rope: Tensor) -> tuple[Tensor, Tensor]:
        """Up-projected rows `kv [n, G·(qk + Dv)]` and the shared RoPE key `rope [n, P]` → `k [n, G, qk + P]`
        (new), `v [n, G, Dv]` (a view of kv), differentiable in both."""
        return _KeysValues.apply(kv, rope, self)

    def rows_gradient(self, grad_k: Tensor, grad_v: Tensor, dtype: torch.dtype) -> Tensor:
        """`dk [n, G, qk + P]`, `dv [n, G, Dv]` → the up-projected rows' gradient `[n, G·(qk + Dv)]` in `dtype`: each
        group's `[dk_nope | dv]`, joined by two copies (`_joined`; the RoPE part of dk is the RoPE key's)."""
        return _joined(grad_k[..., :self.qk_head_dim], grad_v, dtype).flatten(1)

    def keys_values(self, rows: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """Rows `[n, R + P]` → `k [n, G, qk + P]`, `v [n, G, Dv]` (as `linear_kv_up_proj` computes them)."""
        latent, rope = rows.split((weight.shape[1], rows.shape[1] - weight.shape[1]), dim=1)
        k_nope, v = self.split(F.linear(latent, weight))
        return self.with_rope(k_nope, rope), v

    def backward(self, rows: Tensor, weight: Tensor, grad_k: Tensor, grad_v: Tensor,
                 grad_weight: Optional[Tensor]) -> Tensor:
        """`dk [n, G, qk + P]`, `dv [n, G, Dv]` (compute dtype) → the rows' gradient `[n, R + P]` (compute
        dtype); `dW = [dk_nope | dv]ᵀ · latent` is added into `grad_weight` when given. The product with
        `W` runs in W's dtype, as `linear_kv_up_proj`'s backward does (no float32 copy of W per block); the two
        gradients are cast as they are joined (no float32 `[n, G·(qk + Dv)]` copy per block)."""
        grad_kv = self.rows_gradient(grad_k, grad_v, weight.dtype)
        latent = rows[:, :weight.shape[1]]
        if grad_weight is not None:
            grad_weight += grad_kv.t() @ latent.to(weight.dtype)
        grad_rope = grad_k[..., self.qk_head_dim:].sum(1)  # the key shared by all groups
        return torch.cat(((grad_kv @ weight).to(grad_rope.dtype), grad_rope), dim=1)


@dataclass(frozen=True, eq=False)
class LatentKeyValues:
    """An M layer's keys and values, held as what makes them (`layers.context_parallel.KeyValueSource`):
    the rows' normalised KV latent `latent [N, R]` and shared RoPE key `rope [N, P]`, up-projected by the
    layer's `linear_kv_up_proj`."""

    layer: "HybridAttention"
    up: LatentUpProjection
    latent: Tensor
    rope: Tensor

    def expand(self) -> tuple[Tensor, Tensor]:
        """`k [N, G/tp, qk + P]`, `v [N, G/tp, Dv]`, through the layer's modules."""
        kv = apply(self.layer.linear_kv_up_proj, self.latent)
        # One RoPE key shared by all heads; this rank's heads give part of its gradient.
        return self.up.keys_values_of(kv, copy_to_tensor_parallel_region(self.rope, self.layer.tp_group))

    def ring_keys(self) -> RingKeys:
        """The latent and RoPE key per token (`[N, R + P]`, the same on every TP rank: their gradient is
        summed over TP once, here), up-projected by the ring per visiting block with the weight of
        `linear_kv_up_proj`. That needs its plain weight (`DenseMLACore.plain_up_weight`); for another
        up-projection the ring carries the expanded K/V."""
        weight = DenseMLACore.plain_up_weight(self.layer)
        if weight is None:
            return PackedKeyValues.ring_keys(*self.expand())
        rows = copy_to_tensor_parallel_region(torch.cat((self.latent, self.rope), dim=1), self.layer.tp_group)
        return RingKeys(rows, self.up, weight)


def _joined(left: Tensor, right: Tensor, dtype: torch.dtype) -> Tensor:
    """`left [..., a]` and `right [..., b]` (broadcast against each other) → a new `[..., a + b]` in `dtype`, by
    two copies into one allocation: `torch.cat` of a strided or broadcast operand along the last dim takes its
    slow path (on an H200 ≈ 0.37 ms a call for K of `[4096, 128, 128 | 64]`, written at ≈ 0.5 TB/s)."""
    shape = torch.broadcast_shapes(left.shape[:-1], right.shape[:-1])
    width = left.shape[-1]
    out = torch.empty(*shape, width + right.shape[-1], dtype=dtype, device=left.device)
    out[..., :width].copy_(left)
    out[..., width:].copy_(right)
    return out


class _KeysValues(torch.autograd.Function):
    """`LatentUpProjection.keys_values_of`: K joined from the up-projected `k_nope` and the shared RoPE key, V a
    view of the up-projected rows. Backward: the rows' gradient `[dk_nope | dv]` per group joined by two copies
    (what autograd's split backward does with a `cat` of a strided operand), the RoPE key's summed over groups."""

    @staticmethod
    def forward(ctx, kv: Tensor, rope: Tensor, up: "LatentUpProjection") -> tuple[Tensor, Tensor]:
        k_nope, v = up.split(kv)
        ctx.up = up
        return up.with_rope(k_nope, rope), v

    @staticmethod
    def backward(ctx, grad_k: Tensor, grad_v: Tensor) -> tuple[Tensor, Tensor, None]:
        up = ctx.up
        return up.rows_gradient(grad_k, grad_v, grad_k.dtype), grad_k[..., up.qk_head_dim:].sum(1), None


SPARSE_MLA = SparseMLACore()
DENSE_MLA = DenseMLACore()
