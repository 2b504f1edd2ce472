"""Triton decode indexer scores in the CPU interpreter against the reference (`ops.indexer.decode_indexer_scores`,
fp32): ragged counts (none, part of a step, every key, more than the cache holds), heads and dims that pad to
the next power of two, one and several column ranges, keys kept in another dtype than the queries; and decode
steps of a C layer whose indexer runs the kernel against the same steps through the reference op (the reference
decode equals the full forward in float64: tests/test_decoding.py).

Not collected by the default suite: `test_triton_decode_indexer.py` runs this file in a child process under the
interpreter (`triton_support.run_interpreted` says why). Tolerance: fp32 kernel vs fp32 reference differ only
in summation order, atol 1e-5 / rtol 1e-5 on scores of order 1-10.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa.backends import call_counts
from megatron_dsa.backends.triton_kernels import decode_indexer
from megatron_dsa.backends.triton_kernels.decode_indexer import decode_indexer_scores as triton_scores
from megatron_dsa.ops.indexer import decode_indexer_scores as reference_scores
from interp_triton_decode_attention import decode_twins
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")
TOL = dict(atol=1e-5, rtol=1e-5)


def scores_inputs(heads: int, dim: int, width: int = 37, seed: int = 0):
    """Five sequences over a 37-key cache (steps of 16 keys: two whole, one partial): no key yet, a partial first
    step, a count ending inside a later step, every key, and a count past the cache (it counts as every key)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([0, 5, 21, width, width + 4])
    return (torch.randn(5, heads, dim, generator=g), torch.randn(5, width, dim, generator=g),
            torch.randn(5, heads, generator=g), counts)


@pytest.mark.parametrize("heads, dim", [(4, 16), (3, 24), (20, 32)], ids=["h4_d16", "h3_d24_padded", "h20_d32"])
@pytest.mark.parametrize("ranges", [1, 3, None], ids=["one_range", "three_ranges", "default_ranges"])
@pytest.mark.parametrize("keys_major", [True, False], ids=["keys_major", "heads_major"])
def test_op_matches_reference(heads, dim, ranges, keys_major, monkeypatch):
    monkeypatch.setattr(decode_indexer, "KEYS_MAJOR", keys_major)
    q, keys, weights, counts = scores_inputs(heads, dim)
    expected = reference_scores(q, keys, weights, counts, 0.37)
    got = triton_scores(q, keys, weights, counts, 0.37, ranges=ranges)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(torch.isinf(got), torch.isinf(expected))  # −inf exactly past each count
    torch.testing.assert_close(got, expected, **TOL)


def test_keys_in_another_dtype_are_read_in_the_query_dtype():
    q, keys, weights, counts = scores_inputs(4, 16)
    half = keys.half()
    torch.testing.assert_close(triton_scores(q, half, weights, counts, 0.37),
                               reference_scores(q, half, weights, counts, 0.37), **TOL)


def test_weights_as_a_column_slice_are_read_where_they_lie():
    """A decode step's head weights are columns of its stacked projection's rows: the kernel reads them with their
    row stride (no copy), and a layout whose heads are not adjacent is copied first."""
    q, keys, weights, counts = scores_inputs(4, 16)
    stacked = torch.cat((torch.randn(5, 3), weights, torch.randn(5, 2)), dim=1)
    sliced = stacked[:, 3:7]
    assert sliced.stride() == (9, 1)
    expected = reference_scores(q, keys, weights, counts, 0.37)
    torch.testing.assert_close(triton_scores(q, keys, sliced, counts, 0.37), expected, **TOL)
    scattered = torch.stack((weights, torch.randn(5, 4)), dim=-1)[..., 0]
    torch.testing.assert_close(triton_scores(q, keys, scattered, counts, 0.37), expected, **TOL)


@pytest.mark.parametrize("keys_major", [True, False], ids=["keys_major", "heads_major"])
def test_fp8_keys_with_scales_match_the_reference(keys_major, monkeypatch):
    """e4m3 keys and one float32 scale per key (an FP8 cache), against the reference on the same codes and
    scales: the kernel converts the codes to the query dtype exactly and scales each key's score."""
    from megatron_dsa.ops.fp8_linear import quantize_rows

    monkeypatch.setattr(decode_indexer, "KEYS_MAJOR", keys_major)
    q, keys, weights, counts = scores_inputs(4, 16)
    codes, scales = quantize_rows(keys.flatten(0, 1))
    codes, scales = codes.view(keys.shape), scales.view(keys.shape[:2])
    expected = reference_scores(q, codes, weights, counts, 0.37, scales)
    got = triton_scores(q, codes, weights, counts, 0.37, scales, ranges=3)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got, expected, **TOL)


def test_an_empty_cache_and_an_empty_batch():
    q, keys, weights, counts = scores_inputs(4, 16)
    assert triton_scores(q, keys[:, :0], weights, counts, 0.37).shape == (5, 0)
    assert triton_scores(q[:0], keys[:0], weights[:0], counts[:0], 0.37).shape == (0, 37)


@torch.no_grad()
def test_decode_steps_with_the_triton_indexer_match_the_reference_decode():
    """Prefill (reference path) then one token at a time through a C layer whose indexer scores run the Triton
    kernel (counted), against the same steps through the reference op: the same picks every step, outputs to
    fp32 rounding."""
    (expected, expected_picks, _), (got, picks, _) = decode_twins("C", "decode_indexer_scores")
    assert call_counts()[("triton", "decode_indexer_scores")] == 24
    assert torch.equal(picks, expected_picks) and (picks >= 0).any()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_fp8_keys_of_a_head_dim_below_the_e4m3_mma_contraction():
    """DI = 16 (the tiny preset's): the kernel pads the e4m3 dot to its 32-wide contraction (GPUs refuse less)."""
    from megatron_dsa.ops.fp8_linear import quantize_rows

    q, keys, weights, counts = scores_inputs(4, 16, seed=2)
    codes, scales = quantize_rows(keys.flatten(0, 1))
    codes, scales = codes.view(keys.shape), scales.view(keys.shape[:2])
    torch.testing.assert_close(triton_scores(q, codes, weights, counts, 0.37, scales),
                               reference_scores(q, codes, weights, counts, 0.37, scales), **TOL)
