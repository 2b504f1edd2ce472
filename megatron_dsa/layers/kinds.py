"""The layer kinds as data: one `KindSpec` row per kind, and the factory that builds a layer from it.

| kind | compress ratio `r` | indexer | RoPE table | context-parallel halo | core |
|---|---|---|---|---|---|
| `W` | 0 | no | plain, `rotary_base` | `W − 1` (the window) | `SparseMLACore` |
| `C` | 4 | unless `csa_dense_mode` | YaRN, `csa_compress_rotary_base` | window or `2r − 1` | `SparseMLACore` |
| `H` | `hca_compress_ratio` | no | YaRN, `csa_compress_rotary_base` | window or `r − 1` | `SparseMLACore` |
| `M` | - | no | `rope_type` at `rotary_base` | none: keys go round a ring | `DenseMLACore` |

A new kind is one more row: its traits as functions of the config, and a core (an existing one, or a
new `layers.cores.AttentionCore`). `HybridAttention(config, kind=row)` builds a layer of a row that is
not in `KINDS`; one used in `layer_pattern` also needs its letter in `config.LayerKind`, the
pattern's alphabet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

from torch import Tensor

from megatron_dsa.config import HybridAttentionConfig, LayerKind
from megatron_dsa.layers.context_parallel import context_halo
from megatron_dsa.layers.cores import DENSE_MLA, SPARSE_MLA, AttentionCore
from megatron_dsa.ops.rope import plain_inv_freq, yarn_inv_freq

if TYPE_CHECKING:
    from megatron_dsa.layers.hybrid_attention import HybridAttention
    from megatron_dsa.layers.submodules import HybridAttentionSubmodules
    from megatron_dsa.parallel.state import ParallelState


@dataclass(frozen=True)
class KindSpec:
    """One layer kind: its letter, its traits (functions of the config) and its core.

    `compress_ratio`: r of its compressor (0: none). `has_indexer`: whether a lightning indexer picks
    the compressed entries (else every visible entry is attended). `rope_table`: the float64 inverse
    frequencies of every RoPE in the layer `[P/2]`. `halo(config, r)`: the rows before a piece of a
    sequence that its first tokens read, fetched from other context-parallel ranks. `core`: the key/value
    path and attention (`layers.cores`)."""

    symbol: str
    compress_ratio: Callable[[HybridAttentionConfig], int]
    has_indexer: Callable[[HybridAttentionConfig], bool]
    rope_table: Callable[[HybridAttentionConfig], Tensor]
    halo: Callable[[HybridAttentionConfig, int], int]
    core: AttentionCore

    @property
    def kind(self) -> Union[LayerKind, str]:
        """The `LayerKind` of the letter (the plain letter for a kind outside the pattern alphabet)."""
        return LayerKind(self.symbol) if self.symbol in _PATTERN_LETTERS else self.symbol

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


def no_compressor(c: HybridAttentionConfig) -> int:
    return 0


def csa_ratio(c: HybridAttentionConfig) -> int:
    return c.compress_ratio(LayerKind.CSA)


def hca_ratio(c: HybridAttentionConfig) -> int:
    return c.compress_ratio(LayerKind.HCA)


def csa_indexer(c: HybridAttentionConfig) -> bool:
    return c.has_indexer(LayerKind.CSA)


# The ratios and the indexer switch are the config's (Megatron's `csa_compress_ratios` carries them too).
KINDS: dict[str, KindSpec] = {spec.symbol: spec for spec in (
    KindSpec("W", no_compressor, no_indexer, plain_rope_table, window_and_groups_halo, SPARSE_MLA),
    KindSpec("C", csa_ratio, csa_indexer, compressed_rope_table, window_and_groups_halo, SPARSE_MLA),
    KindSpec("H", hca_ratio, no_indexer, compressed_rope_table, window_and_groups_halo, SPARSE_MLA),
    KindSpec("M", no_compressor, no_indexer, mla_rope_table, no_halo, DENSE_MLA),
)}
_PATTERN_LETTERS = frozenset(kind.value for kind in LayerKind)


def resolve_kind(config: HybridAttentionConfig, layer_number: Optional[int],
                 kind: Union[KindSpec, LayerKind, str, None]) -> KindSpec:
    """The row of an explicit `kind` (a letter or a `KindSpec`) or of the config pattern at `layer_number`."""
    if kind is None and layer_number is None:
        raise ValueError("give layer_number (1-indexed, reads config.layer_pattern) or kind (W/C/H/M)")
    from_pattern = config.layer_kind(layer_number).value if layer_number is not None else None
    if kind is None:
        return KINDS[from_pattern]
    spec = kind if isinstance(kind, KindSpec) else KINDS[LayerKind.parse(kind).value]
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
