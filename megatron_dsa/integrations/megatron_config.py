"""Translate between Megatron-Core's `TransformerConfig` and `HybridAttentionConfig`.

Duck-typed on the Megatron side (attributes are read with `getattr`), so it runs without
megatron-core and accepts both released versions (no DeepSeek-V4 fields) and Megatron-LM's `dev`
branch (which adds `csa_*`, `o_groups`, `o_lora_rank`). Rules:

* A field both configs carry is taken from Megatron's config; an override that disagrees with it is
  a conflict (`ValueError`), because the rest of the Megatron model already uses that value.
* A field Megatron's config lacks (or leaves `None`) comes from the overrides, else our default.
* Megatron settings the layer cannot honour (biases, another attention variant, a fixed softmax
  scale, all-to-all context parallelism, qk-clip, MTP) raise `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_dsa.config import KINDS, HybridAttentionConfig, pattern_from_ratios

# Same name and meaning in Megatron's TransformerConfig / MLATransformerConfig and in ours.
SHARED_FIELDS = (
    "hidden_size", "num_attention_heads", "num_layers", "q_lora_rank", "v_head_dim",
    "qk_pos_emb_head_dim", "qk_layernorm", "layernorm_epsilon", "qk_head_dim", "kv_lora_rank",
    "num_query_groups", "rotary_base", "rotary_percent", "rope_type", "rotary_scaling_factor",
    "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
    "dsa_indexer_use_sparse_loss", "calculate_per_token_loss", "sequence_parallel", "init_method_std",
)
# DeepSeek-V4 fields of Megatron-LM `dev`; released megatron-core does not have them.
DSV4_FIELDS = ("csa_window_size", "csa_compress_rotary_base", "csa_dense_mode", "o_groups", "o_lora_rank")
# Ours only: the training loop sets it through the integration (`set_indexer_loss_scale`).
NOT_OVERRIDABLE = ("indexer_loss_backward_scale",)

# Megatron's selective-recompute modules that live inside our layer: either one turns on
# `recompute_attention` (the layer recomputes everything between its input rows and `linear_proj`).
# Full recompute (`recompute_granularity='full'`) is Megatron's own: it wraps whole layers.
RECOMPUTED_IN_THE_LAYER = frozenset({"core_attn", "mla_up_proj"})
_CP_COMM = {"p2p": "p2p", "allgather": "all_gather"}  # Megatron value → ours
_CP_COMM_TO_MEGATRON = {ours: megatron for megatron, ours in _CP_COMM.items()}
_BACKENDS = {"auto": "auto", "unfused": "unfused", "local": "unfused", "flash": "auto", "fused": "auto"}


def hybrid_config_from_megatron(megatron_config: Any, layer_pattern: Optional[str] = None,
                                **overrides: Any) -> HybridAttentionConfig:
    """`HybridAttentionConfig` for the attention layers of a model built from `megatron_config`.

    `layer_pattern` (one letter of `config.KINDS` per layer) is needed unless the config has
    `csa_compress_ratios` (Megatron `dev`); `overrides` give fields the Megatron config lacks, e.g.
    `o_groups=8`.
    """
    _reject_unsupported(megatron_config)
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(HybridAttentionConfig)})
    if unknown:
        raise ValueError(f"unknown HybridAttentionConfig field(s) in overrides: {unknown}")
    fixed = sorted(set(overrides) & set(NOT_OVERRIDABLE))
    if fixed:
        raise ValueError(f"{fixed} cannot be overridden here: under Megatron the training loop sets "
                         f"it with megatron_dsa.integrations.megatron.set_indexer_loss_scale")
    values = dict(overrides)
    for ours, megatron_value in _translated_fields(megatron_config).items():
        _merge(values, ours, megatron_value)
    from_ratios = _pattern_from_ratios(megatron_config, values)
    if layer_pattern is None and from_ratios is None:
        raise ValueError(f"give layer_pattern (one of {'/'.join(KINDS)} per layer): the Megatron config has "
                         f"no csa_compress_ratios")
    config = HybridAttentionConfig.from_dict({**values, "layer_pattern": layer_pattern or from_ratios})
    if from_ratios is not None and config.layer_pattern != from_ratios:
        raise ValueError(f"conflicting values for layer_pattern: csa_compress_ratios gives "
                         f"{from_ratios!r}, the argument {config.layer_pattern!r}")
    return config


def to_megatron_kwargs(config: HybridAttentionConfig, megatron_fields: Optional[set[str]] = None
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `config` into `(TransformerConfig kwargs, overrides for hybrid_config_from_megatron)`.

    `megatron_fields` are the field names of the target Megatron config class (default: the shared
    fields only). Round trip: `hybrid_config_from_megatron(Cls(**kwargs, ...), **overrides)` equals
    `config` (except `indexer_loss_backward_scale`, which the training loop sets).
    """
    names = set(SHARED_FIELDS) if megatron_fields is None else set(megatron_fields)
    kwargs: dict[str, Any] = {"add_bias_linear": False}
    # Ratios held in fields of ours (H's hca_compress_ratio): Megatron has only the per-layer list.
    overrides: dict[str, Any] = {row.ratio: getattr(config, row.ratio) for row in KINDS.values()
                                 if isinstance(row.ratio, str)}

    def put(megatron_name: str, ours: str, value: Any, megatron_value: Any = None) -> None:
        if megatron_name in names:
            kwargs[megatron_name] = value if megatron_value is None else megatron_value
        else:
            overrides[ours] = value

    derived = {"qk_head_dim": config.mla_qk_head_dim, "kv_lora_rank": config.mla_kv_lora_rank,
               "num_query_groups": config.mla_num_query_groups}
    for field in SHARED_FIELDS + DSV4_FIELDS:
        put(field, field, derived.get(field, getattr(config, field)))
    put("cp_partition_mode", "cp_partition", config.cp_partition)
    put("cp_comm_type", "cp_comm_type", config.cp_comm_type, _CP_COMM_TO_MEGATRON[config.cp_comm_type])
    # Megatron's ratio list names only the kinds a ratio alone names (not M, nor most added kinds).
    if "csa_compress_ratios" in names and all(KINDS[symbol].named_by_ratio for symbol in set(config.layer_pattern)):
        kwargs["csa_compress_ratios"] = config.csa_compress_ratios
    else:
        overrides["layer_pattern"] = config.layer_pattern
    if config.attention_backend != "auto":
        overrides["attention_backend"] = config.attention_backend
    return kwargs, overrides


def layer_pattern_from_ratios(ratios: list[int], num_layers: int) -> tuple[str, dict[str, int]]:
    """Megatron's `csa_compress_ratios` → `(layer_pattern, config fields)` (`config.pattern_from_ratios`:
    0 → W, 4 → C, any other ratio → H, which sets `hca_compress_ratio`, one per model). Entries after
    `num_layers` belong to MTP layers and are ignored."""
    if len(ratios) < num_layers:
        raise ValueError(f"csa_compress_ratios has {len(ratios)} entries but num_layers is {num_layers}")
    return pattern_from_ratios(ratios[:num_layers], "csa_compress_ratios")


def _translated_fields(megatron_config: Any) -> dict[str, Any]:
    """Our field name → the value Megatron's config gives it (fields it lacks or leaves None skipped)."""
    out = {}
    for name in SHARED_FIELDS + DSV4_FIELDS:
        value = getattr(megatron_config, name, None)
        if value is not None:
            out[name] = value
    comm = getattr(megatron_config, "cp_comm_type", None)
    if comm is not None:
        out["cp_comm_type"] = cp_comm_type_from_megatron(comm)
    partition = getattr(megatron_config, "cp_partition_mode", None)
    if partition is not None:
        out["cp_partition"] = partition
    granularity = getattr(megatron_config, "recompute_granularity", None)
    modules = set(getattr(megatron_config, "recompute_modules", None) or ())
    if granularity == "selective" and modules & RECOMPUTED_IN_THE_LAYER:
        out["recompute_attention"] = True
    backend = getattr(megatron_config, "attention_backend", None)
    if backend is not None:
        name = getattr(backend, "name", backend)
        if name not in _BACKENDS:
            raise ValueError(f"TransformerConfig.attention_backend {backend!r} is not one of {sorted(_BACKENDS)}")
        if name != "auto":  # auto leaves the choice to an override or our default
            out["attention_backend"] = _BACKENDS[name]
    return out


def cp_comm_type_from_megatron(comm: Any) -> str:
    """Megatron's `cp_comm_type` (one value or one per layer) → ours ('p2p' or 'all_gather')."""
    kinds = set(comm) if isinstance(comm, (list, tuple)) else {comm}
    if len(kinds) != 1 or next(iter(kinds)) not in _CP_COMM:
        raise ValueError(f"TransformerConfig.cp_comm_type must be 'p2p' or 'allgather' for every layer "
                         f"(the hybrid layer has no all-to-all context parallelism), got {comm!r}")
    return _CP_COMM[next(iter(kinds))]


def _merge(values: dict[str, Any], name: str, megatron_value: Any) -> None:
    if name in values and values[name] != megatron_value:
        raise ValueError(f"conflicting values for {name}: the Megatron TransformerConfig has "
                         f"{megatron_value!r}, the override {values[name]!r}; set it in one place")
    values[name] = megatron_value


def _pattern_from_ratios(megatron_config: Any, values: dict[str, Any]) -> Optional[str]:
    """The pattern `csa_compress_ratios` gives (Megatron `dev`), merging the ratio fields it sets; else None."""
    ratios = getattr(megatron_config, "csa_compress_ratios", None)
    if ratios is None:
        return None
    pattern, fields = layer_pattern_from_ratios(list(ratios), values.get("num_layers", 1))
    for name, value in fields.items():
        _merge(values, name, value)
    return pattern


# Megatron settings that must be off (False / None): why the hybrid layer cannot honour them.
_MUST_BE_OFF = {
    "add_bias_linear": "the DeepSeek-V4 attention layer has no biases",
    "softmax_scale": "the hybrid layer fixes its softmax scale (v_head_dim^-1/2)",
    "qk_clip": "qk-clip is not implemented for the hybrid layer",
    "mtp_num_layers": "multi-token prediction layers are not built with the hybrid spec",
}


def _reject_unsupported(megatron_config: Any) -> None:
    for name, why in _MUST_BE_OFF.items():
        value = getattr(megatron_config, name, None)
        if value:
            raise ValueError(f"TransformerConfig.{name} must be False/None here ({why}), got {value!r}")
    variant = getattr(megatron_config, "experimental_attention_variant", None)
    if variant not in (None, "dsv4_hybrid"):
        raise ValueError(f"TransformerConfig.experimental_attention_variant must be None or "
                         f"'dsv4_hybrid' (the hybrid layer replaces the attention), got {variant!r}")
