"""The layer kinds as data: one `KindSpec` row per kind, and the factory that builds a layer from it.

| kind | name | compress ratio `r` | indexer | RoPE table | context-parallel halo | core | in ratio lists |
|---|---|---|---|---|---|---|---|
| `W` | window | 0 | no | plain, `rotary_base` | `W − 1` (the window) | `SparseMLACore` | 0 |
| `C` | CSA | 4 | unless `csa_dense_mode` | YaRN, `csa_compress_rotary_base` | window or `2r − 1` | `SparseMLACore` | 4 |
| `H` | HCA | `hca_compress_ratio` | no | YaRN, `csa_compress_rotary_base` | window or `r − 1` | `SparseMLACore` | any other |
| `M` | dense MLA | 0 | no | `rope_type` at `rotary_base` | none: keys go round a ring | `DenseMLACore` | no |

A new kind is one more row, `register_kind(KindSpec(...))`: its letter, traits (data, or functions of
the config) and a core (an existing one, or a new `layers.cores.AttentionCore`). From then on its
letter is valid in `layer_pattern`, `config.compress_ratio` / `has_indexer` read its row, the Megatron
and Hugging Face translations see it (a kind not `named_by_ratio` travels as `layer_pattern`), and
`megatron-dsa info` lists it. The table itself, `KINDS`, lives in `megatron_dsa.config` (the bottom of
the package, which validates patterns); this module puts the package's four rows in.
`HybridAttention(config, kind=row)` also builds a layer of a row that is not registered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

from torch import Tensor

from megatron_dsa.config import (CSA_COMPRESS_RATIO, KINDS, HybridAttentionConfig, LayerKind, as_layer_kind,
                                 describe_kinds, lookup_kind, register_kind)
from megatron_dsa.layers.context_parallel import context_halo
from megatron_dsa.layers.cores import DENSE_MLA, SPARSE_MLA, AttentionCore
from megatron_dsa.ops.rope import plain_inv_freq, yarn_inv_freq

if TYPE_CHECKING:
    from megatron_dsa.layers.hybrid_attention import HybridAttention
    from megatron_dsa.layers.submodules import HybridAttentionSubmodules
    from megatron_dsa.parallel.state import ParallelState

__all__ = ["KINDS", "KindSpec", "build_attention", "register_kind", "resolve_kind"]


@dataclass(frozen=True)
class KindSpec:
    """One layer kind: its letter, its traits and its core.

    `name`: a few words for messages. `ratio`: r of its compressor (0: none), or the name of the config
    field that holds it. `indexer(config)`: whether a lightning indexer picks the compressed entries
    (else every visible entry is attended). `rope_table(config)`: the float64 inverse frequencies of
    every RoPE in the layer `[P/2]`. `halo(config, r)`: the rows before a piece of a sequence that its
    first tokens read, fetched from other context-parallel ranks. `core`: the key/value path and
    attention (`layers.cores`). `named_by_ratio`: a per-layer ratio list (Megatron's
    `csa_compress_ratios`, the release's `compress_ratios`) names this kind by its ratio alone, as it
    names W, C and H; a kind that is not (M, most new kinds) travels as `layer_pattern` instead."""

    symbol: str
    name: str
    ratio: Union[int, str]
    indexer: Callable[[HybridAttentionConfig], bool]
    rope_table: Callable[[HybridAttentionConfig], Tensor]
    halo: Callable[[HybridAttentionConfig, int], int]
    core: AttentionCore
    named_by_ratio: bool = False

    @property
    def kind(self) -> Union[LayerKind, str]:
        """The `LayerKind` of the letter (the plain letter for a kind registered outside the package)."""
        return as_layer_kind(self.symbol)

    def compress_ratio(self, config: HybridAttentionConfig) -> int:
        return getattr(config, self.ratio) if isinstance(self.ratio, str) else self.ratio

    def has_indexer(self, config: HybridAttentionConfig) -> bool:
        return self.indexer(config)

    def context_halo(self, config: HybridAttentionConfig) -> int:
        return self.halo(config, self.compress_ratio(config))


# ---------------------------------------------------------------- traits the rows share
def plain_rope_table(c: HybridAttentionConfig) -> Tensor:
    """Plain RoPE at `rotary_base` (W layers)."""
    return plain_inv_freq(c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_percent)


def compressed_rope_table(c: HybridAttentionConfig) -> Tensor:
    """YaRN at `csa_compress_rotary_base` (C and H layers, docs/math.md §2.4)."""
    return yarn_inv_freq(c.qk_pos_emb_head_dim, c.csa_compress_rotary_base, c.rotary_scaling_factor,
                         c.original_max_position_embeddings, c.beta_fast, c.beta_slow)


def mla_rope_table(c: HybridAttentionConfig) -> Tensor:
    """M layers: plain or YaRN by `rope_type`, at `rotary_base`."""
    if c.rope_type == "rope":
        return plain_rope_table(c)
    return yarn_inv_freq(c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_scaling_factor,
                         c.original_max_position_embeddings, c.beta_fast, c.beta_slow)


def window_and_groups_halo(c: HybridAttentionConfig, ratio: int) -> int:
    """Sparse kinds: the window, or the compressor groups of a piece's first tokens."""
    return context_halo(c.csa_window_size, ratio)


def no_halo(c: HybridAttentionConfig, ratio: int) -> int:
    """Dense kinds: no halo, the keys of the other ranks arrive whole (ring attention)."""
    return 0


def no_indexer(c: HybridAttentionConfig) -> bool:
    return False


def csa_indexer(c: HybridAttentionConfig) -> bool:
    return not c.csa_dense_mode


for package_kind in (
    KindSpec("W", "window", 0, no_indexer, plain_rope_table, window_and_groups_halo, SPARSE_MLA, named_by_ratio=True),
    KindSpec("C", "CSA", CSA_COMPRESS_RATIO, csa_indexer, compressed_rope_table, window_and_groups_halo, SPARSE_MLA,
             named_by_ratio=True),
    KindSpec("H", "HCA", "hca_compress_ratio", no_indexer, compressed_rope_table, window_and_groups_halo,
             SPARSE_MLA, named_by_ratio=True),
    KindSpec("M", "dense MLA", 0, no_indexer, mla_rope_table, no_halo, DENSE_MLA),
):
    register_kind(package_kind)


def resolve_kind(config: HybridAttentionConfig, layer_number: Optional[int],
                 kind: Union[KindSpec, LayerKind, str, None]) -> KindSpec:
    """The row of an explicit `kind` (a letter or a `KindSpec`) or of the config pattern at `layer_number`."""
    if kind is None and layer_number is None:
        raise ValueError(f"give layer_number (1-indexed, reads config.layer_pattern) or kind (one of "
                         f"{describe_kinds()})")
    from_pattern = lookup_kind(config.layer_kind(layer_number)).symbol if layer_number is not None else None
    if kind is None:
        return KINDS[from_pattern]
    spec = kind if isinstance(kind, KindSpec) else lookup_kind(kind)
    if from_pattern is not None and from_pattern != spec.symbol:
        raise ValueError(f"kind {spec.symbol!r} conflicts with layer_pattern[{layer_number}] = {from_pattern!r}")
    return spec


def build_attention(config: HybridAttentionConfig, layer_number: Optional[int] = None,
                    kind: Union[KindSpec, LayerKind, str, None] = None,
                    parallel_state: Optional["ParallelState"] = None,
                    submodules: Optional["HybridAttentionSubmodules"] = None) -> "HybridAttention":
    """The attention layer of `kind`, or of the pattern's kind at `layer_number` (same as `HybridAttention(...)`)."""
    # Imported here: the layer reads this table, so this module cannot import it at the top.
    from megatron_dsa.layers.hybrid_attention import HybridAttention

    return HybridAttention(config, layer_number, kind, parallel_state, submodules)
