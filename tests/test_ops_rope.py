"""RoPE op tests (docs/math.md §2, bug class A9.2) against the complex-multiplication oracle.

Tolerance: fp64 op vs fp64 oracle, only rounding differs (cos/sin from `math` vs torch, summation
order), so rtol 1e-10 / atol 1e-12 is ~10^5 ulp of headroom and still far below any real error.
"""

import math

import pytest
import torch

from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.rope import (apply_partial_rope, plain_inv_freq, rope, rope_cos_sin,
                                   yarn_correction_range, yarn_inv_freq)
from oracles import (plain_inv_freq_oracle, rope_oracle, yarn_correction_range_oracle,
                           yarn_inv_freq_oracle)

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def _positions(rows: int) -> torch.Tensor:
    """Small and large positions (large ones exercise big angles)."""
    return torch.tensor([0, 1, 2, 7, 63, 4096, 65535, 70001][:rows], dtype=torch.long)


def _inv_freq_tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


@pytest.mark.parametrize("shape", [(8, 12), (8, 3, 12)], ids=["rows", "rows_heads"])
def test_rope_matches_complex_multiplication_oracle(shape):
    x = torch.randn(*shape, dtype=F64)
    inv_freq = _inv_freq_tensor(yarn_inv_freq_oracle(8, 40000.0, 4.0, 65536))  # P = 8 of Dh = 12
    pos = _positions(shape[0])
    for inverse in (False, True):
        got = rope(x, pos, inv_freq, inverse=inverse)
        torch.testing.assert_close(got, rope_oracle(x, pos.tolist(), inv_freq.tolist(), inverse), **TOL)


def test_rope_leaves_first_n_dims_untouched_and_rotates_the_rest():
    x = torch.randn(8, 2, 10, dtype=F64)
    inv_freq = _inv_freq_tensor([1.0, 0.5, 0.25])  # P = 6, N = 4
    got = rope(x, _positions(8), inv_freq)
    assert torch.equal(got[..., :4], x[..., :4])
    assert not torch.allclose(got[1:, :, 4:], x[1:, :, 4:])  # position 0 is the identity
    assert torch.equal(got[0], x[0])


def test_rope_pairs_are_adjacent_not_half_split():
    """A unit vector in slot N+0 (the even slot of pair 0) rotates into slot N+1, not slot N+P/2."""
    x = torch.zeros(1, 8, dtype=F64)
    x[0, 4] = 1.0
    theta = 0.3
    got = rope(x, torch.tensor([1]), _inv_freq_tensor([theta, 0.0]))
    expected = torch.zeros(1, 8, dtype=F64)
    expected[0, 4], expected[0, 5] = math.cos(theta), math.sin(theta)
    torch.testing.assert_close(got, expected, **TOL)


def test_inverse_undoes_rotation():
    x = torch.randn(8, 4, 16, dtype=F64)
    inv_freq = _inv_freq_tensor(yarn_inv_freq_oracle(16, 40000.0, 4.0, 65536))
    pos = _positions(8)
    back = rope(rope(x, pos, inv_freq), pos, inv_freq, inverse=True)
    torch.testing.assert_close(back, x, **TOL)


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_writes_new_storage(inverse):
    """Bug class A1.1 / docs/math.md §2.1: the (inverse) rotation never writes into its input."""
    x = torch.randn(5, 2, 8, dtype=F64)
    before, version = x.clone(), x._version
    inv_freq = _inv_freq_tensor([1.0, 0.1])
    cos, sin = rope_cos_sin(_positions(5), inv_freq, F64)
    for out in (rope(x, _positions(5), inv_freq, inverse=inverse),
                apply_partial_rope(x, cos.unsqueeze(1), sin.unsqueeze(1), inverse=inverse)):
        assert out.data_ptr() != x.data_ptr()
        assert torch.equal(x, before) and x._version == version


def test_rope_full_head_rotation_also_new_storage():
    """P == Dh (no pass-through part) must still return fresh storage."""
    x = torch.randn(3, 4, dtype=F64)
    out = rope(x, _positions(3), _inv_freq_tensor([1.0, 0.5]))
    assert out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, rope_oracle(x, _positions(3).tolist(), [1.0, 0.5]), **TOL)


@pytest.mark.parametrize("rotary_dim, base, percent", [(64, 10000.0, 1.0), (16, 10000.0, 0.5), (16, 500.0, 0.25)])
def test_plain_table(rotary_dim, base, percent):
    got = plain_inv_freq(rotary_dim, base, percent)
    assert got.dtype == F64 and got.shape == (rotary_dim // 2,)
    torch.testing.assert_close(got, _inv_freq_tensor(plain_inv_freq_oracle(rotary_dim, base, percent)),
                               rtol=1e-14, atol=0)


def test_rotary_percent_rotates_only_the_leading_rotary_dims():
    """With rotary_percent 0.5 on P = 8 (Dh = 12): dims 4..7 rotate, the last 4 rope dims pass through."""
    x = torch.randn(6, 12, dtype=F64)
    inv_freq = plain_inv_freq(8, 10000.0, 0.5)
    got = rope(x, _positions(6), inv_freq)
    assert torch.equal(got[:, :4], x[:, :4]) and torch.equal(got[:, 8:], x[:, 8:])
    torch.testing.assert_close(got, rope_oracle(x, _positions(6).tolist(), plain_inv_freq_oracle(8, 10000.0, 0.5)),
                               **TOL)


@pytest.mark.parametrize("base, low, high", [(40000.0, 17, 28), (160000.0, 15, 25)])
def test_yarn_correction_range_recipe_values(base, low, high):
    assert yarn_correction_range(64, base, 65536, 32.0, 1.0) == (low, high)
    assert yarn_correction_range_oracle(64, base, 65536) == (low, high)


@pytest.mark.parametrize("rotary_dim, base, factor, original", [
    (64, 40000.0, 4.0, 65536), (64, 160000.0, 4.0, 65536), (16, 10000.0, 40.0, 4096), (8, 40000.0, 4.0, 65536)])
def test_yarn_table(rotary_dim, base, factor, original):
    got = yarn_inv_freq(rotary_dim, base, factor, original)
    expected = _inv_freq_tensor(yarn_inv_freq_oracle(rotary_dim, base, factor, original))
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=0)


def test_yarn_ramp_endpoints_for_recipe():
    """Pairs below `low` keep the extrapolated frequency, pairs at/after `high` are divided by s."""
    got = yarn_inv_freq(64, 40000.0, 4.0, 65536)
    extra = 40000.0 ** (-torch.arange(0, 64, 2, dtype=F64) / 64)
    torch.testing.assert_close(got[:18], extra[:18], rtol=1e-14, atol=0)
    torch.testing.assert_close(got[28:], extra[28:] / 4.0, rtol=1e-14, atol=0)
    assert torch.all((got[18:28] < extra[18:28]) & (got[18:28] > extra[18:28] / 4.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cos_sin_is_a_pure_rotation(dtype):
    """A9.2 / docs/math.md §2.5: no YaRN mscale baked in, cos² + sin² == 1 and norms are preserved."""
    inv_freq = yarn_inv_freq(64, 40000.0, 4.0, 65536)
    cos, sin = rope_cos_sin(torch.arange(0, 9000, 7), inv_freq, dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.ones_like(cos), rtol=0, atol=tol)
    x = torch.randn(50, 3, 64, dtype=F64)
    y = rope(x, torch.arange(50) * 97, inv_freq)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), **TOL)


def test_compressed_positions_equal_strided_full_table():
    """docs/math.md §2.6: rotating compressed entry `j` at `j·r` equals indexing a table built for the full
    length `C·r` at rows `::r` (here the oracle rotation with angles from that full table)."""
    ratio, lengths = 4, [13, 8]
    layout = TokenLayout(torch.tensor([0, 13, 21]), num_rows=21, max_seqlen=13).compressed(ratio)
    freqs = yarn_inv_freq_oracle(8, 40000.0, 4.0, 65536)
    full_positions = list(range(max(lengths) // ratio * ratio))  # table of length C·r
    strided = [full_positions[j * ratio] for L in lengths for j in range(L // ratio)]
    assert layout.positions.tolist() == strided == [0, 4, 8, 0, 4]
    x = torch.randn(len(strided), 10, dtype=F64)
    torch.testing.assert_close(rope(x, layout.positions, _inv_freq_tensor(freqs)),
                               rope_oracle(x, strided, freqs), **TOL)
