"""Configuration of the hybrid attention layer, and the table of layer kinds it reads its pattern with.

`HybridAttentionConfig` mirrors the Megatron-Core `TransformerConfig` fields the DeepSeek-V4 hybrid
attention reads (names kept so configs translate one to one), plus the per-layer pattern string, one
letter per layer from the kind table `KINDS`. The package's kinds:

    W  window-only attention (compress ratio 0, plain RoPE)
    C  compressed sparse attention (ratio 4, overlapping compressor, lightning indexer top-k)
    H  heavily compressed attention (ratio `hca_compress_ratio`, default 128, all visible entries)
    M  dense causal multi-latent attention (DeepSeek-V3 style)

`KINDS` lives here, at the bottom of the package, so that validating a pattern, the ratio of a kind
and the translations of ratio lists read the same rows the layers are built from; the rows
themselves (`layers.kinds.KindSpec`: traits, RoPE table, halo rule and core) are put in by
`megatron_dsa.layers.kinds` through `register_kind`, which importing `megatron_dsa` runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Protocol, TypeVar, Union

import yaml

CSA_COMPRESS_RATIO = 4
# `HybridAttentionConfig.projection_precision`: the GEMMs of the layer's projections.
PROJECTION_PRECISIONS = ("native", "fp8")


class LayerKind(str, Enum):
    """Names of the package's own kinds (their letters in `KINDS`); a kind registered later has a letter only."""

    WINDOW = "W"
    CSA = "C"
    HCA = "H"
    MLA = "M"

    @classmethod
    def parse(cls, value: Union["LayerKind", str]) -> "LayerKind":
        """The member of a letter (one of the package's own kinds), else ValueError."""
        if isinstance(value, LayerKind):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"layer kind must be one of {[k.value for k in cls]}, got {value!r}"
            ) from None


# ---------------------------------------------------------------- the kind table
class KindRow(Protocol):
    """What the config reads of a row of `KINDS` (the whole row: `layers.kinds.KindSpec`)."""

    symbol: str  # its letter in layer_pattern
    name: str  # a few words for messages
    ratio: Union[int, str]  # compress ratio r (0: none), or the name of the config field holding it
    named_by_ratio: bool  # a per-layer ratio list (Megatron's, the release's) names this kind by r alone

    def compress_ratio(self, config: "HybridAttentionConfig") -> int: ...

    def has_indexer(self, config: "HybridAttentionConfig") -> bool: ...


# Pattern letter → row, in registration order (the package's W, C, H, M first).
KINDS: dict[str, KindRow] = {}
Row = TypeVar("Row", bound=KindRow)


def register_kind(row: Row) -> Row:
    """Adds `row` to `KINDS` under its letter, after checking that the letter is free and one upper-case
    ASCII letter (patterns are upper-cased), that its ratio is an int >= 0 or an int field of the config,
    and that a ratio list still names every kind it names in one way only."""
    symbol = row.symbol
    if not (isinstance(symbol, str) and len(symbol) == 1 and "A" <= symbol <= "Z"):
        raise ValueError(f"a kind's symbol must be one upper-case ASCII letter, got {symbol!r}")
    if symbol in KINDS:
        raise ValueError(f"kind {symbol!r} is already registered ({KINDS[symbol].name})")
    _check_ratio(row)
    if row.named_by_ratio:
        for other in (other for other in KINDS.values() if other.named_by_ratio):
            fixed = isinstance(row.ratio, int)
            if (other.ratio == row.ratio) if fixed else isinstance(other.ratio, str):
                what = f"ratio {row.ratio}" if fixed else "every ratio no kind fixes"
                raise ValueError(f"kinds {other.symbol!r} and {symbol!r} would both be named by {what} in a "
                                 f"per-layer ratio list")
    KINDS[symbol] = row
    return row


def _check_ratio(row: KindRow) -> None:
    ratio = row.ratio
    if isinstance(ratio, str):
        field_type = {f.name: str(f.type) for f in dataclasses.fields(HybridAttentionConfig)}.get(ratio)
        if field_type != "int":
            raise ValueError(f"kind {row.symbol!r}: ratio {ratio!r} is not an int field of HybridAttentionConfig")
    elif not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 0:
        raise ValueError(f"kind {row.symbol!r}: ratio must be an int >= 0 or a config field name, got {ratio!r}")


def lookup_kind(kind: Union[LayerKind, str]) -> KindRow:
    """The row of a kind's letter (or `LayerKind`), else ValueError listing the kinds."""
    symbol = kind.value if isinstance(kind, LayerKind) else kind
    if not isinstance(symbol, str) or symbol not in KINDS:
        raise ValueError(f"layer kind must be one of {describe_kinds()}, got {kind!r}")
    return KINDS[symbol]


def as_layer_kind(symbol: str) -> Union[LayerKind, str]:
    """The `LayerKind` member of a letter, or the letter itself for a kind registered outside the package."""
    return LayerKind(symbol) if symbol in _PACKAGE_LETTERS else symbol


_PACKAGE_LETTERS = frozenset(kind.value for kind in LayerKind)


def describe_kinds() -> str:
    """`W (window), C (CSA), ...`: every kind of the table, for messages."""
    if not KINDS:  # the rows come with megatron_dsa.layers.kinds, which importing megatron_dsa loads
        return "the kinds of megatron_dsa.layers.kinds (not imported yet: none registered)"
    return ", ".join(f"{row.symbol} ({row.name})" for row in KINDS.values())


def pattern_from_ratios(ratios: list[int], what: str) -> tuple[str, dict[str, int]]:
    """A per-layer compress-ratio list (`what`: its name in messages) → `(layer_pattern, config fields)`.

    Each entry names the kind of `KINDS` named by ratio that has it as its fixed ratio (0 → W, 4 → C),
    else the one whose ratio is a config field (H: `hca_compress_ratio`), which the entry then sets:
    one value per model, checked by the config's rule for that field."""
    by_ratio = [row for row in KINDS.values() if row.named_by_ratio]
    fixed = {row.ratio: row for row in by_ratio if isinstance(row.ratio, int)}
    free = next((row for row in by_ratio if isinstance(row.ratio, str)), None)
    symbols, fields = [], {}
    for position, ratio in enumerate(ratios):
        row = fixed.get(ratio, free) if isinstance(ratio, int) and not isinstance(ratio, bool) else None
        if row is None:
            raise ValueError(f"{what}[{position}] = {ratio!r} names no layer kind: "
                             + ", ".join(f"{row.symbol} takes {row.ratio}" for row in by_ratio))
        if row is free:
            _take_field(fields, free, ratio, f"{what}[{position}]", what)
        symbols.append(row.symbol)
    return "".join(symbols), fields


def _take_field(fields: dict[str, int], row: KindRow, ratio: int, where: str, what: str) -> None:
    """Sets `row`'s ratio field to `ratio`, which must be the model's only one and pass the config's rule."""
    taken = fields.setdefault(row.ratio, ratio)
    if taken != ratio:
        raise ValueError(f"{what} mixes {row.name} ratios {sorted((taken, ratio))}: {row.symbol} layers take "
                         f"one ratio per model ({row.ratio})")
    try:
        HybridAttentionConfig(**{row.ratio: ratio})
    except ValueError as error:
        raise ValueError(f"{where} = {ratio}: {error}") from None


@dataclass
class HybridAttentionConfig:
    """All knobs of one stack of hybrid attention layers (shapes in the notation of docs/math.md)."""

    # Model shape.
    hidden_size: int = 4096  # d
    num_attention_heads: int = 64  # H
    num_layers: int = 1
    layer_pattern: str = "C"  # one of W/C/H/M per layer; a single symbol is repeated

    # MLA projections.
    q_lora_rank: int = 1024  # Rq
    v_head_dim: int = 512  # D: head dim of q, of the shared K=V latent, and of V for `M`
    qk_pos_emb_head_dim: int = 64  # P: rotated dims at the end of each head
    o_groups: int = 8  # G
    o_lora_rank: int = 1024  # Ro
    qk_layernorm: bool = True
    layernorm_epsilon: float = 1e-6

    # Dense MLA (`M`) only: DeepSeek-V3 style dims. None means "same as the hybrid layers" (D - P).
    qk_head_dim: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    num_query_groups: Optional[int] = None  # GQA for `M`; None = one KV head per query head

    # Sliding window and compression.
    csa_window_size: int = 128  # W
    hca_compress_ratio: int = 128
    csa_dense_mode: bool = False  # `C` layers attend all visible compressed entries, no indexer

    # Rotary embeddings.
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    csa_compress_rotary_base: float = 40000.0
    rope_type: str = "yarn"  # only read by `M` layers; W/C/H fix their tables by kind (docs/math.md §2.5)
    rotary_scaling_factor: float = 4.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0  # only `M` layers: W/C/H are pure rotations
    mscale_all_dim: float = 1.0

    # Lightning indexer.
    dsa_indexer_n_heads: int = 64  # HI
    dsa_indexer_head_dim: int = 128  # DI
    dsa_indexer_topk: int = 512  # KI
    dsa_indexer_loss_coeff: float = 0.0
    dsa_indexer_use_sparse_loss: bool = True
    calculate_per_token_loss: bool = False
    indexer_loss_backward_scale: float = 1.0  # gradient the KL loss receives (docs/math.md §9)

    # Kernels: "auto" (fastest backend that accepts each call, else the unfused reference) or a
    # backend name for every op; the overrides name one per op family (e.g. {"topk": "cudnn"}),
    # and the names are checked against the registered backends when a layer is built.
    attention_backend: str = "auto"  # "auto" or one backend name for every op family
    attention_backend_overrides: dict[str, str] = field(default_factory=dict)  # op family → backend
    # Projection GEMMs: "native" runs them in the dtype of the rows and weights (bf16 in training); "fp8"
    # rounds both operands of every projection GEMM, forward and backward, to e4m3 with one scale per row
    # (see 'FP8 projections' in section 4). Attention, norms and the indexer loss are never FP8.
    projection_precision: str = "native"  # "native" or "fp8" (the package's own linears)

    # Parallelism (the process groups themselves come with `ParallelState`).
    sequence_parallel: bool = False  # hidden states between layers split along the sequence over TP
    cp_comm_type: str = "p2p"  # context parallelism: "p2p" ring or "all_gather"
    cp_partition: str = "zigzag"  # "zigzag" (load-balanced, 2·cp chunks) or "contiguous"
    cp_ring_key_rows: int = 1024  # M under CP: key rows a ring block expands to K/V at once (memory vs time)

    # Memory: keep only the layer's input rows for backward and recompute the attention (projections,
    # compressor, indexer, core attention, grouped output projection) there.
    recompute_attention: bool = False

    # Parameters.
    init_method_std: float = 0.02
    add_bias_linear: bool = False

    # ---------------------------------------------------------------- validation
    def check_indexer_dims(self) -> None:
        """ValueError unless the lightning indexer can run at these dims (its Walsh-Hadamard rotation and
        its RoPE on the last `qk_pos_emb_head_dim` of its `dsa_indexer_head_dim`)."""
        di = self.dsa_indexer_head_dim
        if di & (di - 1):
            raise ValueError(f"dsa_indexer_head_dim must be a power of two (Walsh-Hadamard), got {di}")
        if self.qk_pos_emb_head_dim > di:
            raise ValueError(f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim}) must not exceed "
                             f"dsa_indexer_head_dim ({di}): the indexer rotates its last P dims")

    def __post_init__(self) -> None:
        check_field_types(self)
        # Sizes first: num_layers = 0 is that mistake, not a layer_pattern of the wrong length.
        _require_positive(self, "hidden_size", "num_attention_heads", "num_layers", "q_lora_rank",
                          "v_head_dim", "o_groups", "o_lora_rank", "csa_window_size",
                          "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "cp_ring_key_rows")
        self.layer_pattern = self._expand_pattern(self.layer_pattern)
        if self.qk_pos_emb_head_dim <= 0 or self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim must be a positive even number (rotary pairs), "
                             f"got {self.qk_pos_emb_head_dim}")
        if self.qk_pos_emb_head_dim >= self.v_head_dim:
            raise ValueError(f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim}) must be smaller than "
                             f"v_head_dim ({self.v_head_dim})")
        if (self.num_attention_heads * self.v_head_dim) % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide num_attention_heads * v_head_dim "
                             f"({self.num_attention_heads * self.v_head_dim})")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide num_attention_heads "
                             f"({self.num_attention_heads}) so that every group holds whole heads")
        if self.hca_compress_ratio < 8:
            raise ValueError(f"hca_compress_ratio must be >= 8 (ratio 4 is the overlapping CSA "
                             f"compressor), got {self.hca_compress_ratio}")
        # Only a pattern with an indexer holds its dims to the indexer's rules (a dense-MLA stack need not
        # mind the indexer defaults); a layer built with another kind than the pattern's checks them itself.
        if any(lookup_kind(kind).has_indexer(self) for kind in set(self.layer_pattern)):
            self.check_indexer_dims()
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"rope_type must be 'rope' or 'yarn', got {self.rope_type!r}")
        if self.rotary_scaling_factor < 1.0:
            raise ValueError(f"rotary_scaling_factor must be >= 1, got {self.rotary_scaling_factor}")
        for name in ("rotary_base", "csa_compress_rotary_base", "init_method_std"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"original_max_position_embeddings must be > 0, got "
                             f"{self.original_max_position_embeddings}")
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"beta_fast ({self.beta_fast}) must be greater than beta_slow ({self.beta_slow}): "
                             f"the YaRN ramp runs from beta_slow to beta_fast rotations")
        if self.dsa_indexer_loss_coeff < 0:
            raise ValueError(f"dsa_indexer_loss_coeff must be >= 0, got {self.dsa_indexer_loss_coeff}")
        if self.layernorm_epsilon <= 0:
            raise ValueError(f"layernorm_epsilon must be > 0, got {self.layernorm_epsilon}")
        if self.cp_comm_type not in ("p2p", "all_gather"):
            raise ValueError(f"cp_comm_type must be 'p2p' or 'all_gather', got {self.cp_comm_type!r}")
        if self.cp_partition not in ("zigzag", "contiguous"):
            raise ValueError(f"cp_partition must be 'zigzag' or 'contiguous', got {self.cp_partition!r}")
        if self.add_bias_linear:
            raise ValueError("add_bias_linear=True is not supported: the DSv4 layer has no biases")
        if self.projection_precision not in PROJECTION_PRECISIONS:
            raise ValueError(f"projection_precision must be one of {list(PROJECTION_PRECISIONS)} (the projections' "
                             f"GEMMs in the rows' dtype, or in FP8 e4m3 with per-row scales), got "
                             f"{self.projection_precision!r}")
        self._validate_backend_fields()
        self._validate_mla()

    def _validate_backend_fields(self) -> None:
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            raise ValueError(f"attention_backend must be a non-empty string ('auto' or a backend name), "
                             f"got {self.attention_backend!r}")
        overrides = self.attention_backend_overrides
        if not isinstance(overrides, dict) or not all(
                isinstance(key, str) and isinstance(value, str) and value for key, value in overrides.items()):
            raise ValueError(f"attention_backend_overrides must map op family names to backend names "
                             f"(strings), got {overrides!r}")

    def _expand_pattern(self, pattern: str) -> str:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"layer_pattern must be a non-empty string of {'/'.join(KINDS)}, got {pattern!r}")
        pattern = pattern.replace(" ", "").upper()
        for position, symbol in enumerate(pattern):
            if symbol not in KINDS:
                raise ValueError(f"layer_pattern symbol {symbol!r} at position {position} is not one "
                                 f"of {describe_kinds()}")
        if len(pattern) == 1:
            return pattern * self.num_layers
        if len(pattern) != self.num_layers:
            raise ValueError(f"layer_pattern has {len(pattern)} symbols but num_layers is "
                             f"{self.num_layers}; give one symbol per layer or a single symbol")
        return pattern

    def _validate_mla(self) -> None:
        for name in ("qk_head_dim", "kv_lora_rank", "num_query_groups"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive when given, got {value}")
        if self.num_attention_heads % self.mla_num_query_groups:
            raise ValueError(f"num_query_groups ({self.mla_num_query_groups}) must divide "
                             f"num_attention_heads ({self.num_attention_heads})")

    # ---------------------------------------------------------------- derived values
    @property
    def nope_head_dim(self) -> int:
        """N = D - P: the un-rotated dims at the front of each head."""
        return self.v_head_dim - self.qk_pos_emb_head_dim

    @property
    def mla_qk_head_dim(self) -> int:
        return self.qk_head_dim if self.qk_head_dim is not None else self.nope_head_dim

    @property
    def mla_kv_lora_rank(self) -> int:
        return self.kv_lora_rank if self.kv_lora_rank is not None else self.nope_head_dim

    @property
    def mla_num_query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def softmax_scale(self) -> float:
        """Hybrid layers: D^-1/2, never YaRN-adjusted (docs/math.md §2.5)."""
        return self.v_head_dim ** -0.5

    def backend_for(self, op: str) -> str:
        """Backend requested for op family `op`: its override, else `attention_backend`."""
        return self.attention_backend_overrides.get(op, self.attention_backend)

    def layer_kind(self, layer_number: int) -> Union[LayerKind, str]:
        """Kind of 1-indexed layer `layer_number` (Megatron numbering): a `LayerKind` for the package's
        own kinds, the letter for one registered outside it."""
        if not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"layer_number must be in [1, {self.num_layers}], got {layer_number}")
        return as_layer_kind(self.layer_pattern[layer_number - 1])

    def compress_ratio(self, kind: Union[LayerKind, str]) -> int:
        """Compression ratio r of a layer kind (0 = no compressor), from its row of `KINDS`."""
        return lookup_kind(kind).compress_ratio(self)

    def has_indexer(self, kind: Union[LayerKind, str]) -> bool:
        """Whether a lightning indexer picks the compressed entries of a layer kind, from its row of `KINDS`."""
        return lookup_kind(kind).has_indexer(self)

    @property
    def csa_compress_ratios(self) -> list[int]:
        """Megatron's per-layer ratio list (a kind a ratio does not name, as `M`, gives its own ratio: 0)."""
        return [self.compress_ratio(symbol) for symbol in self.layer_pattern]

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "HybridAttentionConfig":
        return construct_strict(cls, values)

    def to_yaml(self, path: Union[str, Path]) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_yaml(cls, path: Union[str, Path]) -> "HybridAttentionConfig":
        values = yaml.safe_load(Path(path).read_text()) or {}
        if isinstance(values, dict) and "attention" in values:  # a full job config: its attention section
            values = values["attention"]
        return cls.from_dict(values)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "HybridAttentionConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> "HybridAttentionConfig":
        return dataclasses.replace(self, **changes)


def construct_strict(cls: type, values: Any) -> Any:
    """`cls(**values)` for a dataclass, rejecting unknown keys by name (a YAML typo is an error).
    None (an empty YAML section) gives the defaults; anything but a mapping is a TypeError."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise TypeError(f"{cls.__name__} needs a mapping of field: value, got a {type(values).__name__} "
                        f"({values!r:.60})")
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {unknown}")
    return cls(**values)


def check_field_types(instance: Any) -> None:
    """Every `bool`, `int`, `float` and `str` field of a dataclass holds that type (None where the
    annotation is `Optional`), or ValueError naming the field, the value and the rule.

    YAML makes these easy to get wrong: `'false'` is a string (truthy), `1e-5` without a dot is a
    string in YAML 1.1. Only unambiguous values are converted: an int to a float field, a numeric
    string (`'1e-5'`) to a float field. Float fields must be finite."""
    for spec in dataclasses.fields(instance):
        annotation = str(spec.type).replace(" ", "")
        optional = annotation.startswith("Optional[")
        kind = annotation[len("Optional["):-1] if optional else annotation
        value = getattr(instance, spec.name)
        if (optional and value is None) or kind not in _FIELD_TYPES:
            continue
        setattr(instance, spec.name, _checked(spec.name, value, kind))


_FIELD_TYPES = {"bool": "true or false", "int": "an integer", "float": "a finite number", "str": "a string"}


def _checked(name: str, value: Any, kind: str) -> Any:
    if kind == "float" and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    accepted = {"bool": isinstance(value, bool),
                "int": isinstance(value, int) and not isinstance(value, bool),
                "float": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                "str": isinstance(value, str)}[kind]
    if not accepted:
        raise ValueError(f"{name} must be {_FIELD_TYPES[kind]}, got {value!r} (a {type(value).__name__})")
    return float(value) if kind == "float" else value


def _require_positive(config: HybridAttentionConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def yarn_mscale(scaling_factor: float, mscale: float) -> float:
    """DeepSeek-V3 YaRN magnitude factor `0.1·mscale·ln(s) + 1` (1 when s <= 1)."""
    if scaling_factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


# Layer patterns of the recipes (kinds: docs/math.md §1), MTP layer excluded.
_FLASH_PATTERN = "WWC" + "HC" * 20
_PRO_PATTERN = "HHC" + "HC" * 29

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to train on two CPU cores in minutes; every kind present.
    "tiny": dict(
        hidden_size=128, num_attention_heads=4, num_layers=4, layer_pattern="WCHC",
        q_lora_rank=64, v_head_dim=32, qk_pos_emb_head_dim=8, o_groups=2, o_lora_rank=32,
        csa_window_size=16, hca_compress_ratio=16, dsa_indexer_n_heads=4, dsa_indexer_head_dim=16,
        dsa_indexer_topk=8, dsa_indexer_loss_coeff=0.01, original_max_position_embeddings=256,
    ),
    "dsv4-flash": dict(
        hidden_size=4096, num_attention_heads=64, num_layers=len(_FLASH_PATTERN),
        layer_pattern=_FLASH_PATTERN, q_lora_rank=1024, v_head_dim=512, qk_pos_emb_head_dim=64,
        o_groups=8, o_lora_rank=1024, csa_window_size=128, dsa_indexer_n_heads=64,
        dsa_indexer_head_dim=128, dsa_indexer_topk=512, dsa_indexer_loss_coeff=0.01,
    ),
    "dsv4-pro": dict(
        hidden_size=7168, num_attention_heads=128, num_layers=len(_PRO_PATTERN),
        layer_pattern=_PRO_PATTERN, q_lora_rank=1536, v_head_dim=512, qk_pos_emb_head_dim=64,
        o_groups=16, o_lora_rank=1024, csa_window_size=128, dsa_indexer_n_heads=64,
        dsa_indexer_head_dim=128, dsa_indexer_topk=1024, dsa_indexer_loss_coeff=0.01,
    ),
}
# The released checkpoints (DeepSeek-V4-Flash / -Pro config.json): the recipe's shapes, but their
# compressed branches were trained with RoPE base 160000 and YaRN factor 16 over 65536 positions.
# Released weights under the recipe presets (base 40000, factor 4) load without error and compute
# the wrong rotations; `megatron_dsa.integrations.hf.from_hf_config` reads these from a config.json.
_RELEASED_ROPE = dict(csa_compress_rotary_base=160000.0, rotary_scaling_factor=16.0,
                      original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
PRESETS["dsv4-flash-release"] = {**PRESETS["dsv4-flash"], **_RELEASED_ROPE}
PRESETS["dsv4-pro-release"] = {**PRESETS["dsv4-pro"], **_RELEASED_ROPE}
