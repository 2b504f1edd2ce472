"""FLOP conventions of one attention layer step (forward + backward), shared by `layer.py` (which counts
the rows a layer really attended) and `scaling_model.py` (which counts them from the dims).

Conventions of docs/performance.md: projections `6·T·|W|` (forward, input gradient, weight gradient);
attention `2·H·P·(D_qk + D_v)` forward and `2·H·P·(3·D_qk + 2·D_v)` backward over the `P` attended
(query, key) pairs; the indexer's scores `2·HI·DI` per (query, candidate) pair. Plain Python (no torch),
so the scaling model runs without importing it.
"""

from __future__ import annotations


def projection_flop(tokens: int, weights: int) -> float:
    """Forward + backward of `tokens` rows through `weights` matrix entries."""
    return 6.0 * tokens * weights


def attention_forward_flop(heads: int, pairs: int, qk_dim: int, v_dim: int) -> float:
    return 2.0 * heads * pairs * (qk_dim + v_dim)


def attention_backward_flop(heads: int, pairs: int, qk_dim: int, v_dim: int) -> float:
    return 2.0 * heads * pairs * (3 * qk_dim + 2 * v_dim)


def attention_flop(heads: int, pairs: int, qk_dim: int, v_dim: int) -> float:
    """Forward + backward of attention over `pairs` (query, key) pairs per head."""
    return attention_forward_flop(heads, pairs, qk_dim, v_dim) + attention_backward_flop(heads, pairs, qk_dim, v_dim)


def indexer_score_flop(indexer_heads: int, indexer_dim: int, pairs: int) -> float:
    """The lightning indexer's per-head dots over `pairs` (query, candidate) pairs (one forward)."""
    return 2.0 * indexer_heads * indexer_dim * pairs
