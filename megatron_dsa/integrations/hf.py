"""DeepSeek-V4 checkpoints in Hugging Face or release naming ↔ our attention layers.

Two namings hold the same tensors under different names (relative to one layer's attention):

* `hf`: Hugging Face transformers' `DeepseekV4Model` state dict, `[model.]layers.{i}.self_attn.<name>`
  (`q_a_proj.weight`, `compressor.indexer.q_b_proj.weight`, ...);
* `official`: the released checkpoints, `layers.{i}.attn.<name>` (`wq_a.weight`, `indexer.wq_b.weight`,
  ...); transformers' own saver writes this naming too, under a `model.` prefix.

Both map one to one onto our parameter names (`NAMES`); every tensor keeps its shape. Released
weights are partly FP8 (`float8_e4m3fn`) with one scale per `[bo, bi]` block (`weight_block_size`,
128 × 128 in the releases), stored beside the weight as `<module>.scale` (release, `float8_e8m0fnu`
powers of two) or `<module>.weight_scale_inv` (transformers); the weight is `fp8 · scale` blockwise.

Only attention tensors are read, one at a time from the safetensors files (`safe_open`), so a
checkpoint of hundreds of GB never sits in memory; everything else (MoE, embeddings, hyper-connections,
the MTP block) is counted and left out. The layer kinds come from the checkpoint's `config.json`
(`from_hf_config`), which also carries the released RoPE settings.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import Tensor

from megatron_dsa.config import CSA_COMPRESS_RATIO, HybridAttentionConfig, LayerKind, pattern_from_ratios
from megatron_dsa.integrations.checkpoint import check_layer, join_layers, layer_template, split_layers
from megatron_dsa.parallel.sharding import split_for_tp

# Our name → (transformers name, release name), relative to the attention module.
NAMES: dict[str, tuple[str, str]] = {
    "linear_q_down_proj.weight": ("q_a_proj.weight", "wq_a.weight"),
    "q_layernorm.weight": ("q_a_norm.weight", "q_norm.weight"),
    "linear_q_up_proj.weight": ("q_b_proj.weight", "wq_b.weight"),
    "linear_kv_proj.weight": ("kv_proj.weight", "wkv.weight"),
    "kv_layernorm.weight": ("kv_norm.weight", "kv_norm.weight"),
    "linear_o_group_proj": ("o_a_proj.weight", "wo_a.weight"),
    "linear_proj.weight": ("o_b_proj.weight", "wo_b.weight"),
    "core_attention.attn_sink": ("sinks", "attn_sink"),
    "core_attention.compressor.linear_wkv.weight": ("compressor.kv_proj.weight", "compressor.wkv.weight"),
    "core_attention.compressor.linear_wgate.weight": ("compressor.gate_proj.weight", "compressor.wgate.weight"),
    "core_attention.compressor.ape": ("compressor.position_bias", "compressor.ape"),
    "core_attention.compressor.norm.weight": ("compressor.kv_norm.weight", "compressor.norm.weight"),
    "core_attention.indexer.linear_wq_b.weight": ("compressor.indexer.q_b_proj.weight", "indexer.wq_b.weight"),
    "core_attention.indexer.linear_weights_proj.weight": ("compressor.indexer.scorer.weights_proj.weight",
                                                          "indexer.weights_proj.weight"),
    "core_attention.indexer.compressor.linear_wkv.weight": ("compressor.indexer.kv_proj.weight",
                                                            "indexer.compressor.wkv.weight"),
    "core_attention.indexer.compressor.linear_wgate.weight": ("compressor.indexer.gate_proj.weight",
                                                              "indexer.compressor.wgate.weight"),
    "core_attention.indexer.compressor.ape": ("compressor.indexer.position_bias", "indexer.compressor.ape"),
    "core_attention.indexer.compressor.norm.weight": ("compressor.indexer.kv_norm.weight",
                                                      "indexer.compressor.norm.weight"),
}


@dataclass(frozen=True)
class Naming:
    """Where attention tensors sit in one naming, and how an FP8 weight names its block scale."""

    name: str
    pattern: re.Pattern  # groups: layer index, name inside the attention module
    prefix: str  # written by `ours_to_hf` ("{}" = layer index)
    scale_suffix: str  # replaces the weight's trailing "weight"
    example: str
    column: int  # index into the NAMES pairs
    aliases: tuple[tuple[str, str], ...] = ()  # also accepted on input: (name, our name)

    def to_ours(self) -> dict[str, str]:
        return {pair[self.column]: ours for ours, pair in NAMES.items()} | dict(self.aliases)

    def from_ours(self) -> dict[str, str]:
        return {ours: pair[self.column] for ours, pair in NAMES.items()}


NAMINGS = {
    "hf": Naming("hf", re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn\.(.+)$"), "model.layers.{}.self_attn.",
                 "weight_scale_inv", "model.layers.0.self_attn.q_a_proj.weight", column=0),
    # transformers' saver writes the attention's kv norm as `attn.norm.weight`; the release has `kv_norm`.
    "official": Naming("official", re.compile(r"^(?:.*\.)?layers\.(\d+)\.attn\.(.+)$"), "layers.{}.attn.",
                       "scale", "layers.0.attn.wq_a.weight", column=1,
                       aliases=(("norm.weight", "kv_layernorm.weight"),)),
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK_SIZE = (128, 128)

# ---------------------------------------------------------------------------------------- config

_LAYER_TYPES = {"sliding_attention": LayerKind.WINDOW, "compressed_sparse_attention": LayerKind.CSA,
                "heavily_compressed_attention": LayerKind.HCA}
# transformers' DeepseekV4Config defaults, used where a config.json leaves a key out (as it does).
_HF_DEFAULTS: dict[str, Any] = dict(
    hidden_size=4096, num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=1048576,
)
# Our fields that `from_hf_config` sets from a config.json; the rest keep their defaults.
HF_CONFIG_FIELDS = (
    "hidden_size", "num_attention_heads", "num_layers", "layer_pattern", "q_lora_rank", "v_head_dim",
    "qk_pos_emb_head_dim", "o_groups", "o_lora_rank", "qk_layernorm", "layernorm_epsilon", "csa_window_size",
    "hca_compress_ratio", "rotary_base", "csa_compress_rotary_base", "rotary_scaling_factor",
    "original_max_position_embeddings", "beta_fast", "beta_slow", "dsa_indexer_n_heads",
    "dsa_indexer_head_dim", "dsa_indexer_topk",
)


def read_hf_config(source: Union[str, Path, Mapping[str, Any]]) -> dict[str, Any]:
    """The dict of a config.json (a path, or a checkpoint directory holding one), or a copy of a dict."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        values = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"cannot read the Hugging Face config {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(values).__name__}")
    return values


def from_hf_config(source: Union[str, Path, Mapping[str, Any]], **overrides: Any) -> HybridAttentionConfig:
    """Our `HybridAttentionConfig` for a DeepSeek-V4 `config.json` (transformers' or the release's).

    Per-layer kinds come from `layer_types` (transformers: sliding / compressed_sparse /
    heavily_compressed attention, with `compress_rates`) or `compress_ratios` (the release: 0 / 4 /
    128 per layer, the MTP layer's entry past `num_hidden_layers` ignored). RoPE: W layers plain at
    `rope_theta`; C / H layers YaRN at `compress_rope_theta` with `rope_scaling` (release) or
    `rope_parameters` (transformers), unscaled when the config has no YaRN. Keys the file leaves out
    take transformers' defaults, except the layer kinds, which must be given. `overrides` set any
    other field (e.g. the kernel backend or the indexer loss for fine-tuning)."""
    values = read_hf_config(source)
    model_type = values.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ValueError(f"config model_type is {model_type!r}; from_hf_config reads DeepSeek-V4 ('deepseek_v4')")
    get = lambda key: values[key] if values.get(key) is not None else _HF_DEFAULTS[key]  # noqa: E731
    if "num_hidden_layers" not in values:
        raise ValueError("the config has no num_hidden_layers")
    num_layers = values["num_hidden_layers"]
    if values.get("num_key_value_heads", 1) != 1:
        raise ValueError(f"num_key_value_heads is {values['num_key_value_heads']}; DeepSeek-V4 attention "
                         f"shares one K = V head (num_key_value_heads = 1)")
    if values.get("attention_bias", False):
        raise ValueError("attention_bias = true is not supported: the DeepSeek-V4 attention has no biases")
    pattern, ratio_fields = _layer_pattern(values, num_layers)
    fields = dict(
        hidden_size=get("hidden_size"), num_attention_heads=get("num_attention_heads"), num_layers=num_layers,
        layer_pattern=pattern, q_lora_rank=get("q_lora_rank"), v_head_dim=get("head_dim"),
        qk_pos_emb_head_dim=_rope_head_dim(values, get("head_dim")), o_groups=get("o_groups"),
        o_lora_rank=get("o_lora_rank"), qk_layernorm=True, layernorm_epsilon=get("rms_norm_eps"),
        csa_window_size=get("sliding_window"), **ratio_fields,
        dsa_indexer_n_heads=get("index_n_heads"), dsa_indexer_head_dim=get("index_head_dim"),
        dsa_indexer_topk=get("index_topk"), **_rope_fields(values, get),
    )
    return HybridAttentionConfig.from_dict({**fields, **overrides})


def _layer_pattern(values: Mapping[str, Any], num_layers: int) -> tuple[str, dict[str, int]]:
    """`(W/C/H pattern, the ratio fields it sets: hca_compress_ratio)` of the first `num_layers` layers."""
    if values.get("layer_types") is not None:
        return _pattern_from_layer_types(values, num_layers)
    if values.get("compress_ratios") is not None:
        return _pattern_from_ratios(values["compress_ratios"], num_layers)
    raise ValueError("the config gives no per-layer attention kinds: expected 'layer_types' (transformers) "
                     "or 'compress_ratios' (the release)")


def _pattern_from_layer_types(values: Mapping[str, Any], num_layers: int) -> tuple[str, dict[str, int]]:
    layer_types = list(values["layer_types"])[:num_layers]
    unknown = sorted({t for t in layer_types if t not in _LAYER_TYPES})
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must name {num_layers} layers, each one of {sorted(_LAYER_TYPES)}; "
                         f"got {len(layer_types)} entries" + (f", unknown {unknown}" if unknown else ""))
    rates = dict(values.get("compress_rates") or {})
    rates.setdefault("compressed_sparse_attention", values.get("compress_rate_csa", CSA_COMPRESS_RATIO))
    rates.setdefault("heavily_compressed_attention", values.get("compress_rate_hca", 128))
    if rates["compressed_sparse_attention"] != CSA_COMPRESS_RATIO:
        raise ValueError(f"compressed_sparse_attention compresses by {rates['compressed_sparse_attention']}; "
                         f"our C layers (overlapping compressor) compress by {CSA_COMPRESS_RATIO}")
    pattern = "".join(_LAYER_TYPES[t].value for t in layer_types)
    return pattern, {"hca_compress_ratio": int(rates["heavily_compressed_attention"])}


def _pattern_from_ratios(ratios: Iterable[Any], num_layers: int) -> tuple[str, dict[str, int]]:
    ratios = list(ratios)
    if len(ratios) < num_layers:
        raise ValueError(f"compress_ratios must give a ratio for each of the {num_layers} layers, got {ratios}")
    return pattern_from_ratios(ratios[:num_layers], "compress_ratios")


def _rope_head_dim(values: Mapping[str, Any], head_dim: int) -> int:
    if values.get("qk_rope_head_dim") is not None:
        return int(values["qk_rope_head_dim"])
    factor = values.get("partial_rotary_factor")
    return int(head_dim * factor) if factor is not None else head_dim * 64 // 512


def _rope_fields(values: Mapping[str, Any], get: Any) -> dict[str, Any]:
    """Our RoPE fields: W plain at the main base, C / H YaRN (or plain) at the compressed base."""
    parameters = values.get("rope_parameters") or {}
    nested = isinstance(parameters.get("main"), dict) and isinstance(parameters.get("compress"), dict)
    if nested:
        main, compress = parameters["main"], parameters["compress"]
    else:  # flat: the YaRN settings of the compressed branches (transformers folds them the same way)
        flat = {**(values.get("rope_scaling") or {}), **parameters}
        main, compress = {"rope_type": "default"}, flat
    main_type = main.get("rope_type", main.get("type", "default"))
    if main_type != "default":
        raise ValueError(f"the sliding-window rope is {main_type!r}; our W layers use plain RoPE ('default')")
    fields: dict[str, Any] = dict(rotary_base=float(main.get("rope_theta", get("rope_theta"))),
                                  csa_compress_rotary_base=float(compress.get("rope_theta",
                                                                              get("compress_rope_theta"))))
    compress_type = compress.get("rope_type", compress.get("type", "default"))
    if compress_type == "default":
        return {**fields, "rotary_scaling_factor": 1.0}
    if compress_type != "yarn":
        raise ValueError(f"the compressed-branch rope is {compress_type!r}; ours is 'yarn' or 'default'")
    if compress.get("attention_factor", 1.0) != 1.0:
        raise ValueError(f"the compressed-branch rope has attention_factor {compress['attention_factor']}; "
                         f"our W / C / H rotations are unscaled (1.0)")
    if compress.get("truncate", True) is not True:
        raise ValueError("the compressed-branch YaRN has truncate = false; ours rounds the ramp bounds (true)")
    original = compress.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("the compressed-branch YaRN has no original_max_position_embeddings")
    factor = compress.get("factor") or get("max_position_embeddings") / original
    return {**fields, "rotary_scaling_factor": float(factor), "original_max_position_embeddings": int(original),
            "beta_fast": float(compress.get("beta_fast", 32.0)), "beta_slow": float(compress.get("beta_slow", 1.0))}


# ---------------------------------------------------------------------------------------- tensors

def dequantize_fp8(weight: Tensor, scale: Tensor, block_size: tuple[int, int], scale_fmt: Optional[str] = None,
                   name: str = "weight") -> Tensor:
    """`weight [O, I]` (FP8) times its block scales `scale [ceil(O/bo), ceil(I/bi)]` → float32.

    Scales are float32 / bfloat16, `float8_e8m0fnu`, or uint8 bytes of e8m0 (`scale_fmt` 'ue8m0')."""
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    expected = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}: block scale has shape {tuple(scale.shape)}, expected {expected} for a "
                         f"{(rows, cols)} weight in {block_rows} x {block_cols} blocks (weight_block_size)")
    if scale.dtype == torch.uint8:
        if scale_fmt != "ue8m0":
            raise ValueError(f"{name}: uint8 block scales need quantization_config.scale_fmt = 'ue8m0'")
        factors = torch.exp2(scale.to(torch.float32) - 127.0)
    else:
        factors = scale.to(torch.float32)
    factors = factors.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return weight.to(torch.float32) * factors


class SafetensorsCheckpoint:
    """Tensors of one or more safetensors files, read one at a time (`with` keeps the files open)."""

    def __init__(self, files: list[Path]):
        from safetensors import SafetensorError, safe_open

        self._stack = ExitStack()
        self.location: dict[str, Any] = {}
        for path in files:
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError, ValueError) as error:
                self._stack.close()
                raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): "
                                 f"{error}") from None
            for key in handle.keys():
                self.location[key] = (handle, path)

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def keys(self) -> list[str]:
        return list(self.location)

    def get(self, key: str) -> Tensor:
        handle, path = self.location[key]
        try:
            return handle.get_tensor(key)
        except Exception as error:  # noqa: BLE001 - a damaged payload fails in the Rust reader
            raise ValueError(f"{path}: cannot read {key!r} (truncated or corrupt?): {error}") from None


def checkpoint_files(source: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (its index's files when it has one) or a file."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise ValueError(f"{source} is neither a safetensors file nor a checkpoint directory")
    index = source / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [source / name for name in sorted(set(weight_map.values()))]
        missing = [str(path) for path in files if not path.is_file()]
        if missing:
            raise ValueError(f"{index} names files that are not there: {missing}")
        return files
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{source} holds no .safetensors files")
    return files


def detect_naming(keys: Iterable[str]) -> str:
    """'hf' or 'official': the naming whose attention keys the checkpoint holds."""
    keys = list(keys)
    found = [name for name, naming in NAMINGS.items() if any(naming.pattern.match(key) for key in keys)]
    if len(found) != 1:
        expected = "; ".join(f"{name} (e.g. {naming.example})" for name, naming in NAMINGS.items())
        what = "both" if found else "neither"
        raise ValueError(f"the checkpoint's attention tensors match {what} of the known namings: {expected}")
    return found[0]


def hf_to_ours(checkpoint: SafetensorsCheckpoint, config: HybridAttentionConfig, tp_size: int = 1,
               dtype: torch.dtype = torch.bfloat16, quantization: Optional[Mapping[str, Any]] = None,
               ) -> tuple[list[dict[str, Tensor]], list[str], str]:
    """`(tp_size state dicts in our layout, keys left out, naming)` of a Hugging Face or release checkpoint.

    FP8 weights are dequantized to `dtype`; other tensors keep their stored dtype. Every layer of
    `config` must be present with the shapes its kind gives; all problems of a layer are listed in
    one ValueError."""
    naming = NAMINGS[detect_naming(checkpoint.keys())]
    renames = naming.to_ours()
    quantization = quantization or {}
    block_size = tuple(quantization.get("weight_block_size") or DEFAULT_BLOCK_SIZE)
    layers: dict[int, dict[str, str]] = {}  # layer → our name → checkpoint key
    others = []
    for key in checkpoint.keys():
        match = naming.pattern.match(key)
        if match is None:
            others.append(key)
        elif match.group(2).endswith("." + naming.scale_suffix):
            continue  # read with its weight
        else:
            name = match.group(2)  # a name outside the table stays as it is: check_layer reports it
            layers.setdefault(int(match.group(1)), {})[renames.get(name, name)] = key
    expected = set(range(config.num_layers))
    if set(layers) != expected:
        raise ValueError(f"the checkpoint has attention layers {sorted(layers)}, its config "
                         f"({config.num_layers} layers, pattern {config.layer_pattern}) expects {sorted(expected)}")
    out: list[dict[int, dict[str, Tensor]]] = [{} for _ in range(tp_size)]
    for index in sorted(expected):
        shapes, dims = layer_template(config, index + 1)
        keys = layers[index]
        state = {}
        for ours, key in keys.items():
            state[ours] = _read(checkpoint, key, naming, block_size, quantization.get("scale_fmt"), dtype)
        check_layer(state, shapes, f"layer {index} ({config.layer_pattern[index]})")
        for rank, piece in enumerate(split_for_tp(state, dims, tp_size)):
            out[rank][index] = piece
    return [join_layers(layer_states, "ours") for layer_states in out], sorted(others), naming.name


def _read(checkpoint: SafetensorsCheckpoint, key: str, naming: Naming, block_size: tuple[int, int],
          scale_fmt: Optional[str], dtype: torch.dtype) -> Tensor:
    tensor = checkpoint.get(key)
    if tensor.dtype not in FP8_DTYPES:
        return tensor
    scale_key = key[: -len("weight")] + naming.scale_suffix
    if not key.endswith(".weight") or scale_key not in checkpoint.location:
        raise ValueError(f"{key!r} is FP8 ({tensor.dtype}) but the checkpoint has no block scale {scale_key!r}")
    return dequantize_fp8(tensor, checkpoint.get(scale_key), block_size, scale_fmt, key).to(dtype)


def ours_to_hf(state: Mapping[str, Tensor], config: HybridAttentionConfig, naming: str = "hf"
               ) -> tuple[dict[str, Tensor], list[str]]:
    """`(attention tensors in `naming`, keys left out)` of a TP = 1 state dict in our layout.

    Kind M (dense MLA) has no DeepSeek-V4 counterpart and is refused."""
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {sorted(NAMINGS)}, got {naming!r}")
    dense = [i for i, kind in enumerate(config.layer_pattern) if kind == LayerKind.MLA.value]
    if dense:
        raise ValueError(f"layers {dense} are dense MLA (M), which DeepSeek-V4 checkpoints do not have")
    layers, others = split_layers(state, "ours")
    expected = set(range(config.num_layers))
    if set(layers) != expected:
        raise ValueError(f"the state dict has attention layers {sorted(layers)}, the config "
                         f"({config.num_layers} layers, pattern {config.layer_pattern}) expects {sorted(expected)}")
    target = NAMINGS[naming]
    renames = target.from_ours()
    out = {}
    for index in sorted(expected):
        shapes, _ = layer_template(config, index + 1)
        check_layer(layers[index], shapes, f"layer {index} ({config.layer_pattern[index]})")
        prefix = target.prefix.format(index)
        out.update({prefix + renames[name]: value for name, value in layers[index].items()})
    return out, others
