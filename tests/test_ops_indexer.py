"""Lightning-indexer score and top-k tests (docs/math.md §6.2–6.3; bug classes A2.1, A3.5, A4.1).

Scores: fp64 op vs fp64 scalar oracle, rtol 1e-10 / atol 1e-12 (summation order only). Selections
are integers and compared exactly.
"""

import pytest
import torch

from megatron_dsa.ops.fp8_linear import quantize_rows
from megatron_dsa.ops.indexer import decode_indexer_scores, indexer_scores
from megatron_dsa.ops.indices import topk_columns, visible_compressed_indices
from megatron_dsa.ops.layout import TokenLayout
from oracles import INVALID, indexer_scores_oracle, pick_columns, topk_oracle, visible_compressed_oracle

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
SCALE = 0.37  # deliberately not 1 and not DI^-1/2: a doubly applied scale cannot hide (A2.1)


def _inputs(tokens, heads, dim, entries, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(entries, dim, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(tokens, heads, generator=gen, dtype=F64, requires_grad=True)
    return q, k, w


def _random_candidates(tokens, width, entries, seed=1):
    gen = torch.Generator().manual_seed(seed)
    cand = torch.randint(0, entries, (tokens, width), generator=gen)
    cand[torch.rand(tokens, width, generator=gen) < 0.3] = INVALID
    cand[0] = INVALID  # one row with no candidate at all
    return cand


def test_scores_match_oracle_with_non_unit_scale():
    q, k, w = _inputs(tokens=6, heads=3, dim=5, entries=4)
    cand = _random_candidates(6, 5, 4)
    got = indexer_scores(q, k, w, cand, SCALE)
    expected = indexer_scores_oracle(q, k, w, cand.tolist(), SCALE)
    assert got.dtype == F64 and got.shape == cand.shape
    invalid = cand < 0
    assert torch.all(torch.isneginf(got[invalid])) and torch.all(torch.isfinite(got[~invalid]))
    torch.testing.assert_close(got[~invalid], expected[~invalid], **TOL)
    # the scale enters exactly once: linear in `scale`
    torch.testing.assert_close(got[~invalid], SCALE * indexer_scores(q, k, w, cand, 1.0)[~invalid], **TOL)


def test_score_grads_match_oracle_autograd():
    """A2.1: the backward sees the same single scale as the forward (q, k, weights grads)."""
    q, k, w = _inputs(tokens=5, heads=2, dim=4, entries=6, seed=3)
    cand = _random_candidates(5, 4, 6, seed=4)
    valid = cand >= 0
    upstream = torch.randn(cand.shape, dtype=F64)
    got = torch.autograd.grad((indexer_scores(q, k, w, cand, SCALE)[valid] * upstream[valid]).sum(), (q, k, w))
    oracle = indexer_scores_oracle(q, k, w, cand.tolist(), SCALE)
    expected = torch.autograd.grad((oracle[valid] * upstream[valid]).sum(), (q, k, w))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL)


def test_scores_with_no_compressed_keys():
    q, _, w = _inputs(tokens=3, heads=2, dim=4, entries=1)
    k = torch.zeros(0, 4, dtype=F64)
    got = indexer_scores(q, k, w, torch.full((3, 2), INVALID), SCALE)
    assert got.shape == (3, 2) and torch.all(torch.isneginf(got))


@pytest.mark.parametrize("topk", [1, 2, 3, 10])
def test_topk_over_visible_entries_matches_brute_force(topk):
    """docs/math.md §6.3: per row, the `min(KI, C)` best visible entries (ties to lower index), −1 padded;
    all −1 for `t < r−1`; every selection lies in the ratio-causal visible set (A3.5)."""
    ratio, lengths = 4, [13, 13]
    layout = TokenLayout.uniform(2, 13, torch.device("cpu"))
    clayout = layout.compressed(ratio)
    candidates = visible_compressed_indices(clayout)  # [T, 3] compressed rows, −1 = not visible
    q, k, w = _inputs(tokens=26, heads=4, dim=4, entries=clayout.capacity, seed=topk)
    with torch.no_grad():
        scores = indexer_scores(q, k, w, candidates, SCALE)
        oracle_scores = indexer_scores_oracle(q, k, w, candidates.tolist(), SCALE)
    valid = candidates >= 0
    columns = topk_columns(scores, valid, topk)
    assert columns.tolist() == topk_oracle(oracle_scores.tolist(), valid.tolist(), topk)
    selected = pick_columns(candidates, columns)
    visible = visible_compressed_oracle(lengths, ratio)
    for t, row in enumerate(selected.tolist()):
        chosen = [i for i in row if i != INVALID]
        assert len(chosen) == min(topk, len(visible[t])) == len(set(chosen))
        assert set(chosen) <= set(visible[t])
        assert row[len(chosen):] == [INVALID] * (len(row) - len(chosen))
    positions = layout.positions
    assert torch.all(selected[positions < ratio - 1] == INVALID)


def test_indexer_scores_function_gradcheck_and_chunking(monkeypatch):
    """The chunked recompute-in-backward Function: gradcheck (fp64), and identical results when
    every row is its own chunk. Negative dots exercise the ReLU gate, −1 candidates the masking."""
    import megatron_dsa.ops.indexer as indexer_module

    torch.manual_seed(0)
    q = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    candidates = torch.tensor([[0, 1, -1], [2, 5, 3], [-1, -1, -1], [4, 0, 1], [5, -1, 2]])

    def finite_scores(q, k, w):
        scores = indexer_module.indexer_scores(q, k, w, candidates, 0.37)
        return torch.where(candidates >= 0, scores, 0.0)

    assert torch.autograd.gradcheck(finite_scores, (q, k, w))
    whole = finite_scores(q, k, w)
    monkeypatch.setattr(indexer_module, "CHUNK_ELEMENTS", 1)
    assert torch.equal(finite_scores(q, k, w), whole)


# ----------------------------------------------------------------------- decode: one query row per sequence
def _decode_inputs(batch=4, heads=3, dim=5, width=7, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, dim, generator=gen, dtype=F64), torch.randn(batch, width, dim, generator=gen,
            dtype=F64), torch.randn(batch, heads, generator=gen, dtype=F64))


def test_decode_scores_match_the_oracle_on_each_sequences_own_keys(monkeypatch):
    """Sequence b's row against its first counts[b] keys (ragged, one sequence with none, one past the width,
    which counts as the width), −inf after them; the same with one sequence per chunk."""
    import megatron_dsa.ops.indexer as indexer_module

    q, keys, w = _decode_inputs()
    counts = torch.tensor([3, 0, 7, 9])
    width = keys.shape[1]
    candidates = [[b * width + j if j < min(int(counts[b]), width) else INVALID for j in range(width)]
                  for b in range(4)]
    expected = indexer_scores_oracle(q, keys.flatten(0, 1), w, candidates, SCALE)
    got = decode_indexer_scores(q, keys, w, counts, SCALE)
    assert got.dtype == F64 and got.shape == (4, width)
    torch.testing.assert_close(got, expected, **TOL)
    monkeypatch.setattr(indexer_module, "CHUNK_ELEMENTS", 1)
    assert torch.equal(decode_indexer_scores(q, keys, w, counts, SCALE), got)


def test_decode_scores_read_keys_in_the_query_dtype():
    """float32 queries over float64 keys: the keys are rounded to float32 first (as the layer's `.to(q.dtype)`)."""
    q, keys, w = _decode_inputs()
    counts = torch.tensor([7, 7, 7, 7])
    got = decode_indexer_scores(q.float(), keys, w.float(), counts, SCALE)
    assert got.dtype == torch.float32
    assert torch.equal(got, decode_indexer_scores(q.float(), keys.float(), w.float(), counts, SCALE))


@pytest.mark.parametrize("change, error, match", [
    (lambda q, k, w, c: (q[0], k, w, c), ValueError, "q must be"),
    (lambda q, k, w, c: (q, k[:, :, :4], w, c), ValueError, "keys must be"),
    (lambda q, k, w, c: (q, k, w[:, :2], c), ValueError, "weights must be"),
    (lambda q, k, w, c: (q, k, w, c[:3]), ValueError, "counts must be"),
    (lambda q, k, w, c: (q, k, w, c.float()), TypeError, "counts must be int32/int64"),
])
def test_decode_scores_name_the_bad_argument(change, error, match):
    q, keys, w = _decode_inputs()
    with pytest.raises(error, match=match):
        decode_indexer_scores(*change(q, keys, w, torch.tensor([3, 0, 7, 9])), SCALE)


def test_decode_scores_of_fp8_keys_are_those_of_the_rounded_queries_and_keys():
    """e4m3 keys with one scale per key (an FP8 cache): the scores of the dequantized keys `keys · scale` against
    the query rows rounded to e4m3 with one scale each (amax / 448), dequantized, to float64 rounding (the scales,
    positive, leave the ReLU: the reference applies them to the weights and after the head sum)."""
    q, keys, w = _decode_inputs()
    counts = torch.tensor([3, 0, 7, 9])
    codes, scales = quantize_rows(keys.flatten(0, 1))
    codes, scales = codes.view(keys.shape), scales.view(keys.shape[:2]).float()
    q_codes, q_scales = quantize_rows(q.flatten(0, 1))
    rounded_q = (q_codes.to(F64) * q_scales).view(q.shape)
    assert not torch.equal(rounded_q, q)
    got = decode_indexer_scores(q, codes, w, counts, SCALE, scales)
    expected = decode_indexer_scores(rounded_q, codes.to(F64) * scales.to(F64).unsqueeze(-1), w, counts, SCALE)
    assert got.dtype == F64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fp8_keys, key_scales, error, match", [
    (True, None, TypeError, "key_scales come with keys of dtype torch.float8_e4m3fn"),
    (False, torch.ones(4, 9), TypeError, "key_scales come with keys of dtype torch.float8_e4m3fn"),
    (True, torch.ones(4, 8), ValueError, "key_scales must be float32"),
    (True, torch.ones(4, 9, dtype=F64), ValueError, "key_scales must be float32"),
], ids=["fp8_without_scales", "scales_without_fp8", "scales_shape", "scales_dtype"])
def test_decode_scores_name_bad_key_scales(fp8_keys, key_scales, error, match):
    q, keys, w = _decode_inputs()
    keys = keys.to(torch.float8_e4m3fn) if fp8_keys else keys
    with pytest.raises(error, match=match):
        decode_indexer_scores(q, keys, w, torch.tensor([3, 0, 7, 9]), SCALE, key_scales)
