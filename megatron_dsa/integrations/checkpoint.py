"""Attention state dicts between Megatron-Core checkpoints and ours, at any tensor-parallel size.

A layer's parameter names are Megatron's (relative to `self_attention.`), so interchange is about
where the layers sit and how they are split:

* `megatron` layout: `decoder.layers.{i}.self_attention.<name>` (a `GPTModel` state dict; a
  wrapper prefix such as `module.` before `decoder.` is accepted on input);
* `ours` layout: `layers.{i}.self_attention.<name>` (`megatron_dsa.model.HybridLM`).

`i` is 0-based in both. Transformer-Engine specs fuse the q/kv norms into the following linear
(`linear_q_up_proj.layer_norm_weight`); those names are read as `q_layernorm.weight` /
`kv_layernorm.weight`, and Transformer-Engine `_extra_state` entries are dropped. Every layer is
checked against the layer the config builds: missing keys, unexpected keys and shape mismatches are
reported together in one `ValueError`. Tensors outside the attention layers are not converted.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

import torch
from torch import Tensor

from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.layers.hybrid_attention import HybridAttention
from megatron_dsa.parallel.sharding import merge_tp_shards, partition_dims, split_for_tp

LAYOUTS = {"megatron": "decoder.layers.{}.self_attention.", "ours": "layers.{}.self_attention."}
_PATTERNS = {"megatron": re.compile(r"^(?:.*\.)?decoder\.layers\.(\d+)\.self_attention\.(.+)$"),
             "ours": re.compile(r"^layers\.(\d+)\.self_attention\.(.+)$")}
_FUSED_NORMS = {"linear_q_up_proj.layer_norm_weight": "q_layernorm.weight",
                "linear_kv_up_proj.layer_norm_weight": "kv_layernorm.weight"}
EXTRA_STATE_SUFFIX = "_extra_state"

LayerStates = dict[int, dict[str, Tensor]]


def split_layers(state: Mapping[str, Tensor], layout: str) -> tuple[LayerStates, list[str]]:
    """`(layer index → {name: tensor}, keys outside the attention layers)` of a state dict."""
    pattern = _pattern(layout)
    layers: LayerStates = {}
    others = []
    for key, value in state.items():
        match = pattern.match(key)
        if match is None:
            others.append(key)
            continue
        name = match.group(2)
        if name.endswith(EXTRA_STATE_SUFFIX):
            continue
        layers.setdefault(int(match.group(1)), {})[_FUSED_NORMS.get(name, name)] = value
    return layers, others


def join_layers(layers: LayerStates, layout: str) -> dict[str, Tensor]:
    _pattern(layout)  # validates the name
    prefix = LAYOUTS[layout]
    return {prefix.format(index) + name: value for index, layer in sorted(layers.items())
            for name, value in layer.items()}


def layer_template(config: HybridAttentionConfig, layer_number: int
                   ) -> tuple[dict[str, torch.Size], dict[str, Optional[int]]]:
    """`(TP = 1 shapes, split dims)` of layer `layer_number` (1-indexed), built on the meta device."""
    with torch.device("meta"):
        layer = HybridAttention(config, layer_number=layer_number)
    return {name: value.shape for name, value in layer.state_dict().items()}, partition_dims(layer)


def check_layer(state: Mapping[str, Tensor], shapes: Mapping[str, torch.Size], where: str) -> None:
    """Raise one `ValueError` listing every missing key, unexpected key and wrong shape."""
    problems = [f"missing key {name!r}" for name in shapes if name not in state]
    problems += [f"unexpected key {name!r}" for name in state if name not in shapes]
    problems += [f"{name!r} has shape {tuple(state[name].shape)}, expected {tuple(shapes[name])}"
                 for name in shapes if name in state and state[name].shape != shapes[name]]
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def convert_attention(shards: list[Mapping[str, Tensor]], config: HybridAttentionConfig,
                      source: str = "megatron", target: str = "ours", tp_size: int = 1
                      ) -> tuple[list[dict[str, Tensor]], list[str]]:
    """Attention layers of `shards` (TP ranks in order; one for TP = 1) in `source` layout →
    `tp_size` state dicts in `target` layout, plus the keys that were not converted.

    Every layer of `config` must be present, with the shapes its kind and the TP size give."""
    if not shards:
        raise ValueError("give at least one state dict")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    per_rank = [split_layers(shard, source) for shard in shards]
    found = set().union(*(layers.keys() for layers, _ in per_rank))
    expected = set(range(config.num_layers))
    if found != expected:
        raise ValueError(f"the state dict has attention layers {sorted(found)}, the config "
                         f"({config.num_layers} layers, pattern {config.layer_pattern}) expects "
                         f"{sorted(expected)}")
    out: list[LayerStates] = [{} for _ in range(tp_size)]
    for index in sorted(expected):
        shapes, dims = layer_template(config, index + 1)
        local = _shard_shapes(shapes, dims, len(shards))
        parts = []
        for rank, (layers, _) in enumerate(per_rank):
            where = f"layer {index} ({config.layer_pattern[index]})" + (f", TP rank {rank}" if len(shards) > 1 else "")
            check_layer(layers.get(index, {}), local, where)
            parts.append(layers[index])
        full = merge_tp_shards(parts, dims) if len(parts) > 1 else dict(parts[0])
        for rank, piece in enumerate(split_for_tp(full, dims, tp_size)):
            out[rank][index] = piece
    return [join_layers(layers, target) for layers in out], sorted(set().union(*(o for _, o in per_rank)))


def _shard_shapes(shapes: Mapping[str, torch.Size], dims: Mapping[str, Optional[int]], tp_size: int
                  ) -> dict[str, torch.Size]:
    local = {}
    for name, shape in shapes.items():
        dim = dims.get(name)
        local[name] = shape if dim is None else shape[:dim] + (shape[dim] // tp_size,) + shape[dim + 1:]
    return local


def _pattern(layout: str) -> re.Pattern:
    if layout not in _PATTERNS:
        raise ValueError(f"layout must be one of {sorted(_PATTERNS)}, got {layout!r}")
    return _PATTERNS[layout]
