"""Megatron-Core integration: our `HybridAttention` as the `self_attention` of a `TransformerLayer`.

    from megatron_dsa.integrations.megatron import hybrid_gpt_model, set_indexer_loss_scale

    model = hybrid_gpt_model(transformer_config, vocab_size=32000, max_sequence_length=4096,
                             layer_pattern="WWC" + "HC" * 20, o_groups=8, o_lora_rank=1024)

The layer spec reuses a Megatron layer spec (default: the local, non-Transformer-Engine one with
RMSNorm) and swaps in `MegatronHybridAttention`, which takes Megatron's constructor arguments
(`config`, `layer_number`, `pg_collection`, `cp_comm_type`), reads its kind from the layer pattern
at its (global, 1-indexed) layer number, and answers Megatron's `self_attention(...)` call with
`(output, None)`. Parameter names are Megatron's, so `decoder.layers.{i}.self_attention.*` is the
Megatron-Core DSv4 attention state dict.

Indexer KL loss (docs/math.md §9, §14): each training forward records the coefficient-scaled loss in
Megatron's DSA indexer-loss tracker (`DSAIndexerLossLoggingHelper`, which Megatron-LM's training
loop logs as "indexer loss"; the MoE aux-loss tracker too on request), and its backward scale is
the process-wide value set by `set_indexer_loss_scale`, which the training loop sets before every
step to `indexer_loss_scale(...)` (Megatron's rule for auxiliary losses).

Position signals: a `GPTModel` with learned absolute position embeddings is rejected when our
layers are built into it, and its `position_ids` are checked against the positions the layers use.

megatron-core is imported only when something is built, so this module imports without it.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional

import torch
from torch import Tensor, nn

from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.integrations.megatron_config import cp_comm_type_from_megatron, hybrid_config_from_megatron
from megatron_dsa.layers.common import RMSNorm
from megatron_dsa.layers.hybrid_attention import HybridAttention
from megatron_dsa.layers.submodules import HybridAttentionSubmodules
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.parallel.sharding import partition_dims
from megatron_dsa.parallel.state import ParallelState, group_rank, group_size

INDEXER_LOSS_NAME = "indexer loss"  # key in Megatron's auxiliary-loss tracker
INSTALL_HINT = 'this needs megatron-core: pip install "megatron_dsa[megatron]"'
_indexer_loss_scale = 1.0  # process-wide, like Megatron's MoE / MTP loss auto-scalers


def require_megatron() -> None:
    """Raise an `ImportError` with the install command when megatron-core is missing."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error


# ------------------------------------------------------------ indexer loss scale (docs/math.md §14)
def indexer_loss_scale(num_microbatches: int, cp_size: int = 1, calculate_per_token_loss: bool = False,
                       loss_scale: float = 1.0) -> float:
    """Megatron's backward scale for an auxiliary loss: `loss_scale · cp / num_microbatches`
    (`loss_scale` alone in per-token mode).

    `loss_scale` is the mixed-precision loss scale (`optimizer.get_loss_scale().item()`, 1.0 for
    bf16/fp32). The cp factor undoes the data-and-context-parallel gradient average: our CP ranks'
    indexer losses already sum to the global mean."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if calculate_per_token_loss:
        return float(loss_scale)
    return float(loss_scale) * cp_size / num_microbatches


def set_indexer_loss_scale(scale: float) -> None:
    """Backward scale of every `MegatronHybridAttention` indexer loss from the next forward on."""
    global _indexer_loss_scale
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale < 0:
        raise ValueError(f"indexer loss scale must be a non-negative float, got {scale!r}")
    _indexer_loss_scale = float(scale)


def get_indexer_loss_scale() -> float:
    return _indexer_loss_scale


# ---------------------------------------------------------------- process groups
def parallel_state_from_megatron(pg_collection: Any = None) -> ParallelState:
    """Our `ParallelState` from a Megatron `ProcessGroupCollection` (None: Megatron's global groups).

    Groups of size 1 become None, so a single-rank dimension runs no collective."""
    if pg_collection is None:
        require_megatron()
        from megatron.core.process_groups_config import ProcessGroupCollection
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()

    def group(name: str):
        found = getattr(pg_collection, name, None)
        return found if found is not None and group_size(found) > 1 else None

    return ParallelState(tp_group=group("tp"), cp_group=group("cp"), dp_group=group("dp"))


# ---------------------------------------------------------------- the attention module
class MegatronHybridAttention(HybridAttention):
    """`HybridAttention` built and called the way Megatron's `TransformerLayer` builds and calls
    `self_attention`, for every kind (the kind's row in `layers.kinds.KINDS` picks its core).

    forward(hidden_states `[S, B, d]` (`[S/tp, B, d]` under sequence parallelism, `[T, 1, d]`
    packed), ..., packed_seq_params) → `(output [same shape], None)`.
    """

    def __init__(self, config: Any, layer_number: int, hybrid_config: HybridAttentionConfig,
                 pg_collection: Any = None, cp_comm_type: Optional[str] = None,
                 indexer_loss_in_moe_tracker: bool = False,
                 submodules: Optional["MegatronHybridAttentionSubmodules"] = None):
        if not isinstance(hybrid_config, HybridAttentionConfig):
            raise TypeError(f"hybrid_config must be a HybridAttentionConfig, got "
                            f"{type(hybrid_config).__name__}")
        state = parallel_state_from_megatron(pg_collection)
        _check_group_sizes(config, state)
        _use_per_layer_checkpoint_keys(config)
        _check_enclosing_gpt_model(state, hybrid_config.cp_partition)
        self.indexer_loss_in_moe_tracker = indexer_loss_in_moe_tracker
        # Own copy per layer: the per-layer cp_comm_type and the indexer-loss scale live in it.
        own = (hybrid_config.replace(cp_comm_type=cp_comm_type_from_megatron(cp_comm_type))
               if cp_comm_type is not None else dataclasses.replace(hybrid_config))
        built = (submodules or MegatronHybridAttentionSubmodules()).builders(config)
        super().__init__(own, layer_number=layer_number, parallel_state=state, submodules=built)
        self._mark_megatron_tensor_parallel()
        self.to(**megatron_placement(config))

    def _mark_megatron_tensor_parallel(self) -> None:
        """Megatron's TP attributes on our split parameters (grad-norm de-duplication, checkpoints)."""
        dims = partition_dims(self)
        for name, param in self.named_parameters():
            dim = dims[name]
            param.tensor_model_parallel = dim is not None
            param.partition_dim = -1 if dim is None else dim
            param.partition_stride = 1

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,  # type: ignore[override]
                key_value_states: Optional[Tensor] = None, inference_context: Any = None,
                rotary_pos_emb: Any = None, rotary_pos_cos: Optional[Tensor] = None,
                rotary_pos_sin: Optional[Tensor] = None, rotary_pos_cos_sin: Optional[Tensor] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params: Any = None,
                sequence_len_offset: Optional[Tensor] = None, *, inference_params: Any = None
                ) -> tuple[Tensor, Optional[Tensor]]:
        """Megatron's `self_attention` call. `attention_mask`: None, causal, or causal within
        documents (`--reset-attention-mask`), see `HybridAttention.forward`; other masks raise."""
        _reject_arguments(key_value_states=key_value_states, inference_context=inference_context,
                          inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
                          rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                          rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                          sequence_len_offset=sequence_len_offset)
        self.config.indexer_loss_backward_scale = _indexer_loss_scale
        output, bias = super().forward(hidden_states, attention_mask,
                                       packed_seq_params=packed_from_megatron(packed_seq_params))
        if self.training and self.last_indexer_loss is not None:
            self._track_indexer_loss(self.last_indexer_loss)
        return output, bias

    def _track_indexer_loss(self, loss: Tensor) -> None:
        """Into Megatron's DSA indexer-loss tracker, which Megatron-LM's training loop logs as
        "indexer loss"; into the MoE auxiliary-loss tracker too when built with
        `indexer_loss_in_moe_tracker=True`. CP ranks' losses are parts of one mean (the trackers sum
        them over CP); TP ranks hold identical values."""
        cp_group = self.parallel_state.cp_group
        track_dsa_indexer_loss(loss, self.layer_number, self.config.num_layers, cp_group)
        if self.indexer_loss_in_moe_tracker:
            from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker
            save_to_aux_losses_tracker(INDEXER_LOSS_NAME, loss, self.layer_number, self.config.num_layers,
                                       reduce_group=cp_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Megatron distributed-checkpoint entries `{prefix + name: ShardedTensor}` of this layer.

        TP-split parameters (`partition_dims`: q up-projection and grouped output projection along
        dim 0, attention sinks `[heads/tp]` along dim 0, `linear_proj` along dim 1) are TP fragments
        of one global tensor; the rest (norms, down-projections, compressor, indexer) are replicated
        over TP. Every CP and DP rank holds a full copy, so only the first one is the main replica
        (the one that is written). `sharded_offsets` (Megatron's stacked-layer axis, empty with the
        per-layer keys `__init__` selects) are prepended. `metadata` is not needed."""
        return _sharded_tensors(self.state_dict(prefix="", keep_vars=True), prefix, partition_dims(self),
                                tuple(sharded_offsets), self.parallel_state)


@dataclasses.dataclass
class MegatronHybridAttentionSubmodules:
    """Megatron classes (or `ModuleSpec`s) for the layer's parallel projections and q / kv norms,
    the `submodules` of its `ModuleSpec`; None keeps the package's own (see `layers.submodules`).

    `column_parallel_linear`: `linear_q_up_proj` (and M's `linear_kv_up_proj`), e.g. Megatron's
    `ColumnParallelLinear` or Transformer Engine's `TEColumnParallelLinear`; `row_parallel_linear`:
    `linear_proj` (`RowParallelLinear`, `TERowParallelLinear`); `norm`: `q_layernorm` /
    `kv_layernorm` (`TENorm`, Apex's `FusedLayerNorm` with RMSNorm, `WrappedTorchNorm`). They are
    built with Megatron's constructor arguments (`config`, `init_method`, `bias=False`, the layer's TP
    group). The layer gathers a sequence-parallel input itself, so column-parallel linears and norms
    get a copy of the config with `sequence_parallel=False`; the row-parallel one keeps it (its
    reduce-scatter returns the sequence-parallel output)."""

    column_parallel_linear: Any = None
    row_parallel_linear: Any = None
    norm: Any = None

    def builders(self, megatron_config: Any) -> HybridAttentionSubmodules:
        """Our builders, calling Megatron's `build_module` for every class given."""
        from megatron.core.transformer.spec_utils import build_module

        gathered = (dataclasses.replace(megatron_config, sequence_parallel=False)
                    if getattr(megatron_config, "sequence_parallel", False) else megatron_config)

        def column(in_features: int, out_features: int, tp_group: Any, std: float) -> nn.Module:
            return build_module(self.column_parallel_linear, in_features, out_features, config=gathered,
                                init_method=_normal_init(std), bias=False, gather_output=False,
                                skip_bias_add=False, is_expert=False, tp_group=tp_group)

        def row(in_features: int, out_features: int, tp_group: Any, std: float, sequence_parallel: bool) -> nn.Module:
            return build_module(self.row_parallel_linear, in_features, out_features, config=megatron_config,
                                init_method=_normal_init(std), bias=False, input_is_parallel=True,
                                skip_bias_add=False, is_expert=False, tp_group=tp_group)

        def norm(dim: int, eps: float) -> nn.Module:
            return build_module(self.norm, config=gathered, hidden_size=dim, eps=eps)

        return HybridAttentionSubmodules(
            column_parallel_linear=column if self.column_parallel_linear is not None else None,
            row_parallel_linear=row if self.row_parallel_linear is not None else None,
            norm=norm if self.norm is not None else None)


def _normal_init(std: float):
    """Megatron's `init_method`: fills a weight with N(0, std) in place (Megatron calls it on the whole
    TP = 1 weight when initialising on the CPU, so the shards are its slices, as ours are)."""
    return lambda weight: torch.nn.init.normal_(weight, mean=0.0, std=std)


def packed_from_megatron(params: Any) -> Optional[PackedSeqParams]:
    """Megatron's `PackedSeqParams` (or ours, or None) → ours; dynamic CP is rejected."""
    if params is None or isinstance(params, PackedSeqParams):
        return params
    if getattr(params, "local_cp_size", None) is not None or getattr(params, "cp_group", None) is not None:
        raise ValueError("packed_seq_params.local_cp_size / cp_group (dynamic context parallelism) are "
                         "not supported by the hybrid layer; use the model's fixed CP group")
    if getattr(params, "qkv_format", "thd") not in ("thd", None):
        raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {params.qkv_format!r}")

    def host_int(value: Any) -> Optional[int]:
        return int(value) if isinstance(value, Tensor) else value

    return PackedSeqParams(cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_kv=params.cu_seqlens_kv,
                           cu_seqlens_q_padded=params.cu_seqlens_q_padded,
                           cu_seqlens_kv_padded=params.cu_seqlens_kv_padded,
                           max_seqlen_q=host_int(params.max_seqlen_q),
                           max_seqlen_kv=host_int(params.max_seqlen_kv))


_WHY_REJECTED = {
    "key_value_states": "the hybrid layer is self-attention only",
    "inference_context": "KV-cache inference is not implemented",
    "inference_params": "KV-cache inference is not implemented",
    "attention_bias": "attention biases are not supported",
    "sequence_len_offset": "KV-cache inference is not implemented",
}
_ROTARY_HINT = ("the hybrid layer applies its own RoPE; build the GPTModel with "
                "position_embedding_type='none'")


def _reject_arguments(**given: Any) -> None:
    for name, value in given.items():
        if value is not None:
            why = _WHY_REJECTED.get(name, _ROTARY_HINT)
            raise ValueError(f"self_attention got {name}, which must be None: {why}")


def _check_group_sizes(config: Any, state: ParallelState) -> None:
    for field, size, what in (("tensor_model_parallel_size", state.tp_size, "tp"),
                              ("context_parallel_size", state.cp_size, "cp")):
        expected = getattr(config, field, 1)
        if expected != size:
            raise ValueError(f"TransformerConfig.{field} is {expected} but the {what} process group "
                             f"has {size} ranks")


def track_dsa_indexer_loss(loss: Tensor, layer_number: int, num_layers: int, reduce_group: Any) -> None:
    """Add `loss` to Megatron's DSA indexer-loss tracker (`DSAIndexerLossLoggingHelper`), whose
    values Megatron-LM's `training_log` reduces and reports; the tracker's buffer is made on the
    loss's device (Megatron's own helper would put it on the current CUDA device)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    tracker = DSAIndexerLossLoggingHelper.tracker
    if "values" not in tracker:
        tracker["values"] = torch.zeros(num_layers, device=loss.device)
    DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss, layer_number, num_layers, reduce_group=reduce_group)


def tracked_indexer_losses(clear: bool = True) -> list[float]:
    """Per-layer indexer losses in the DSA tracker since it was last cleared, summed over this rank's
    context-parallel group (what Megatron-LM's logging reports per layer, before its DP average)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    tracker = DSAIndexerLossLoggingHelper.tracker
    if "values" not in tracker:
        return []
    values = tracker["values"].detach().clone()
    if tracker.get("reduce_group") is not None:
        torch.distributed.all_reduce(values, group=tracker["reduce_group"])
    if clear:
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    return values.tolist()


# ---------------------------------------------------------------- position signals
def _check_enclosing_gpt_model(state: ParallelState, cp_partition: str) -> None:
    """Reject a `GPTModel` that would add a second position signal, and have it check its position_ids.

    The layer spec cannot see the model it is built into, so the `GPTModel` under construction is
    found on the call stack (its `__init__` sets `position_embedding_type` before building the
    decoder). Learned absolute position embeddings would be added to the input on top of the
    layers' RoPE: rejected. The model then gets a forward pre-hook (once) that rejects position_ids
    the layers cannot honour (see `check_position_ids`)."""
    from megatron.core.models.gpt import GPTModel

    frame = sys._getframe(1)
    while frame is not None and not isinstance(frame.f_locals.get("self"), GPTModel):
        frame = frame.f_back
    if frame is None:
        return
    model = frame.f_locals["self"]
    embedding = getattr(model, "position_embedding_type", None)
    if embedding == "learned_absolute":
        raise ValueError(f"GPTModel(position_embedding_type='learned_absolute') would add learned absolute "
                         f"position embeddings on top of the hybrid layers' RoPE; {_ROTARY_HINT}")
    if not getattr(model, "_hybrid_position_check", False):
        model._hybrid_position_check = True
        model.register_forward_pre_hook(
            lambda module, args, kwargs: _gpt_position_ids_hook(args, kwargs, state, cp_partition),
            with_kwargs=True)


def _gpt_position_ids_hook(args: tuple, kwargs: dict, state: ParallelState, cp_partition: str) -> None:
    names = ("input_ids", "position_ids", "attention_mask")
    given = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
    if given.get("position_ids") is not None and given.get("input_ids") is not None:
        check_position_ids(given["position_ids"], given.get("attention_mask"), tuple(given["input_ids"].shape),
                           state.cp_size, state.cp_rank, cp_partition)


def check_position_ids(position_ids: Tensor, attention_mask: Optional[Tensor], shape: tuple[int, int],
                       cp_size: int = 1, cp_rank: int = 0, cp_partition: str = "zigzag") -> None:
    """The hybrid layers derive positions themselves: 0, 1, ... along each sequence, restarting at
    every document a document mask keeps apart. `position_ids [B | 1, S/cp]` (this CP rank's part)
    must say the same, or ValueError: a model that fed other positions (Megatron's
    `--reset-attention-mask` without `--reset-position-ids`, offsets) would be silently ignored.
    One host synchronisation per call."""
    from megatron_dsa.packed_seq import documents_from_attention_mask
    from megatron_dsa.parallel.context import shard_sequence

    batch, local = shape
    seqlen = local * cp_size
    documents = None
    if attention_mask is not None and cp_size == 1:
        documents = documents_from_attention_mask(attention_mask, batch, seqlen)
    rows = torch.arange(batch * seqlen, device=position_ids.device)
    if documents is None:
        expected = (rows % seqlen).view(batch, seqlen)
    else:
        bounds = documents.to(position_ids.device, torch.long)
        expected = (rows - torch.repeat_interleave(bounds[:-1], bounds[1:] - bounds[:-1])).view(batch, seqlen)
    if cp_size > 1:
        expected = shard_sequence(expected, cp_size, cp_rank, cp_partition, dim=1)
    if not torch.equal(position_ids.expand(batch, local).to(expected.dtype), expected):
        raise ValueError("position_ids must count 0, 1, ... along each sequence and restart at every document the "
                         "attention_mask separates (Megatron's --reset-position-ids with --reset-attention-mask): "
                         "the hybrid layers compute RoPE positions themselves and cannot take others")


# ---------------------------------------------------------------- specs and models
def hybrid_layer_spec(hybrid_config: HybridAttentionConfig, base_layer_spec: Any = None,
                      indexer_loss_in_moe_tracker: bool = False,
                      attention_submodules: Optional[MegatronHybridAttentionSubmodules] = None) -> Any:
    """A `TransformerLayer` `ModuleSpec` whose `self_attention` is `MegatronHybridAttention`.

    `base_layer_spec` supplies everything else (norms, MLP, bias-dropout-add); default: Megatron's
    local spec with RMSNorm. Its `input_layernorm` must be a real norm (a Transformer-Engine spec
    fuses it into `linear_qkv`, which the hybrid layer does not have). The indexer losses go to
    Megatron's DSA tracker; `indexer_loss_in_moe_tracker` adds them to the MoE aux-loss tracker.
    `attention_submodules` picks Megatron / Transformer Engine classes for the attention's parallel
    projections and q / kv norms (`MegatronHybridAttentionSubmodules`; default: the package's own)."""
    require_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    base = base_layer_spec if base_layer_spec is not None else get_gpt_layer_local_spec(normalization="RMSNorm")
    submodules = getattr(base, "submodules", None)
    if submodules is None or not hasattr(submodules, "self_attention"):
        raise TypeError("base_layer_spec must be a TransformerLayer ModuleSpec with submodules")
    if submodules.input_layernorm is IdentityOp:
        raise ValueError("base_layer_spec has no input_layernorm (a Transformer-Engine spec fuses it into "
                         "linear_qkv); use a spec with a separate norm, e.g. "
                         "get_gpt_layer_local_spec(normalization='RMSNorm')")
    attention = ModuleSpec(module=MegatronHybridAttention, submodules=attention_submodules, params={
        "hybrid_config": hybrid_config, "indexer_loss_in_moe_tracker": indexer_loss_in_moe_tracker})
    norms = {name: sequence_parallel_norm(getattr(submodules, name), hybrid_config)
             for name in ("input_layernorm", "pre_mlp_layernorm")}
    return ModuleSpec(module=base.module, params=dict(base.params),
                      submodules=dataclasses.replace(submodules, self_attention=attention, **norms))


def sequence_parallel_norm(norm: Any, hybrid_config: HybridAttentionConfig) -> Any:
    """`norm`, or `MegatronRMSNorm` where `norm` is Megatron's torch norm under sequence parallelism
    (which it refuses; Transformer Engine and Apex norms are kept)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return MegatronRMSNorm if hybrid_config.sequence_parallel and norm is WrappedTorchNorm else norm


class MegatronRMSNorm(RMSNorm):
    """Our RMSNorm behind Megatron's norm signature `(config, hidden_size, eps)`, for specs that need
    sequence parallelism without Transformer Engine or Apex.

    Under sequence parallelism each rank normalises only its rows, so the weight's gradient is
    partial: the weight carries Megatron's `sequence_parallel` attribute and Megatron's
    `finalize_model_grads` sums it over the TP group (a loop of your own must do the same)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any):
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"MegatronRMSNorm needs TransformerConfig.normalization='RMSNorm', got "
                             f"{config.normalization!r}")
        super().__init__(hidden_size, eps, "auto")
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        self.to(**megatron_placement(config))


def megatron_placement(config: Any) -> dict[str, Any]:
    """Where Megatron puts a module's parameters: the current CUDA device unless
    `use_cpu_initialization` (or no CUDA), in `params_dtype`."""
    cuda = torch.cuda.is_available() and not getattr(config, "use_cpu_initialization", False)
    return {"device": torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
            "dtype": getattr(config, "params_dtype", torch.float32)}


def hybrid_gpt_model(megatron_config: Any, vocab_size: int, max_sequence_length: int,
                     layer_pattern: Optional[str] = None, base_layer_spec: Any = None,
                     gpt_kwargs: Optional[dict[str, Any]] = None, indexer_loss_in_moe_tracker: bool = False,
                     attention_submodules: Optional[MegatronHybridAttentionSubmodules] = None,
                     **hybrid_overrides: Any) -> Any:
    """A Megatron-Core `GPTModel` whose attention layers are ours.

    `hybrid_overrides` give the hybrid fields `megatron_config` lacks (see
    `hybrid_config_from_megatron`); `gpt_kwargs` go to `GPTModel` (its position embedding is always
    'none': the layers rotate q and k themselves); `indexer_loss_in_moe_tracker` and
    `attention_submodules`: see `hybrid_layer_spec`."""
    require_megatron()
    from megatron.core.models.gpt import GPTModel

    gpt_kwargs = dict(gpt_kwargs or {})
    embedding = gpt_kwargs.pop("position_embedding_type", "none")
    if embedding != "none":
        raise ValueError(f"position_embedding_type must be 'none' ({_ROTARY_HINT}), got {embedding!r}")
    hybrid = hybrid_config_from_megatron(megatron_config, layer_pattern, **hybrid_overrides)
    spec = hybrid_layer_spec(hybrid, base_layer_spec, indexer_loss_in_moe_tracker, attention_submodules)
    if hybrid.sequence_parallel:  # the final norm too: Megatron's default block norm refuses SP
        from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                                 get_num_layers_to_build)
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        blocks = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(megatron_config),
                                            layer_norm=sequence_parallel_norm(WrappedTorchNorm, hybrid))
        spec = ModuleSpec(module=TransformerBlock, submodules=blocks)
    return GPTModel(megatron_config, spec, vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length, position_embedding_type="none", **gpt_kwargs)


# ---------------------------------------------------------------- distributed checkpoints
def _use_per_layer_checkpoint_keys(megatron_config: Any) -> None:
    """Make Megatron's `TransformerBlock` checkpoint every layer under its own keys
    (`decoder.layers.{i}.…`) instead of stacking all layers' same-named tensors along a layer axis.

    Stacking needs every layer to hold the same names and shapes, which a mixed pattern breaks (a W
    layer has no compressor, C and H compressors differ in shape, only C has an indexer, M is another
    module). It is set for every pattern, uniform ones included, which save correctly either way:
    one layout keeps a checkpoint's keys those of the model's `state_dict` whatever the pattern, the
    keys carry global layer numbers (so pipeline resharding still works), and Megatron itself is
    retiring the stacked layout (`non_homogeneous_layers=False` is deprecated there). The flag is
    read when the block builds its sharded state dict, so setting it while the layers are built is
    in time. The misspelling is Megatron's field name."""
    megatron_config.hetereogenous_dist_checkpoint = True


def _sharded_tensors(state: dict[str, Tensor], prefix: str, dims: dict[str, Optional[int]],
                     sharded_offsets: tuple, parallel_state: ParallelState) -> dict[str, Any]:
    """`{prefix + name: ShardedTensor}` for a module's local `state` (`dims`: TP split dim or None).

    Replica ids follow Megatron's `(0, tp replica, data-and-context replica)`: a TP fragment is
    unique within its TP group (middle 0), a TP-replicated tensor is a replica on every TP rank but
    the first. The last entry is the rank in the data-and-context-parallel group."""
    from megatron.core.dist_checkpointing import ShardedTensor

    tp_rank, tp_size = parallel_state.tp_rank, parallel_state.tp_size
    data_replica = _data_and_context_rank(parallel_state)
    prepended = len(sharded_offsets)
    out = {}
    for name, tensor in state.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{prefix}{name}: only tensors can be checkpointed, got {type(tensor).__name__}")
        dim, key = dims.get(name), f"{prefix}{name}"
        if dim is None:
            offsets, replica_id = sharded_offsets, (0, tp_rank, data_replica)
        else:
            offsets, replica_id = (*sharded_offsets, (prepended + dim, tp_rank, tp_size)), (0, 0, data_replica)
        out[key] = ShardedTensor.from_rank_offsets(key, tensor, *offsets, replica_id=replica_id,
                                                   prepend_axis_num=prepended)
    return out


def _data_and_context_rank(parallel_state: ParallelState) -> int:
    """This rank's index in its data-and-context-parallel group (CP fastest, as Megatron orders it):
    0 only on the first CP rank of the first DP replica, distinct on every other rank."""
    return group_rank(parallel_state.dp_group) * parallel_state.cp_size + parallel_state.cp_rank


def save_dist_checkpoint(sharded_state_dict: dict[str, Any], directory: str) -> None:
    """`megatron.core.dist_checkpointing.save` into `directory` (created if missing), also where
    torch has no CUDA. Collective: every rank of the default group calls it with its own
    `sharded_state_dict` (e.g. `{"model": model.sharded_state_dict(), "step": 7}`; plain values must
    be equal on all ranks and go to the common file)."""
    require_megatron()
    from pathlib import Path

    from megatron.core import dist_checkpointing

    Path(directory).mkdir(parents=True, exist_ok=True)
    with _HostOnlyCudaCalls():
        dist_checkpointing.save(sharded_state_dict, str(directory))


def load_dist_checkpoint(sharded_state_dict: dict[str, Any], directory: str) -> dict[str, Any]:
    """`megatron.core.dist_checkpointing.load`: the state dict of this rank's shards (for
    `model.load_state_dict`), read from a checkpoint saved under any TP / CP / DP sizes."""
    require_megatron()
    from pathlib import Path

    from megatron.core import dist_checkpointing

    if not (Path(directory) / "metadata.json").is_file():
        raise ValueError(f"{directory} is not a Megatron distributed checkpoint (no metadata.json)")
    with _HostOnlyCudaCalls():
        return dist_checkpointing.load(sharded_state_dict, str(directory))


class _HostOnlyCudaCalls:
    """Without CUDA, stand in for the two CUDA calls of Megatron's `torch_dist` saver (a context).

    After staging tensors to host memory it calls `torch.cuda.synchronize()` (host tensors: nothing
    to wait for), and it broadcasts its failure flag from `torch.cuda.current_device()` (a CPU tensor
    works over gloo). Both raise on a torch without CUDA, so CPU runs could not checkpoint at all.
    With CUDA nothing changes; the originals are restored on exit."""

    def __init__(self) -> None:
        self.originals: Optional[tuple[Any, Any]] = None

    def __enter__(self) -> None:
        if not torch.cuda.is_available():
            self.originals = torch.cuda.synchronize, torch.cuda.current_device
            torch.cuda.synchronize = lambda device=None: None
            torch.cuda.current_device = lambda: "cpu"

    def __exit__(self, *exception: Any) -> None:
        if self.originals is not None:
            torch.cuda.synchronize, torch.cuda.current_device = self.originals
