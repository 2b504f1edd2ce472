"""Hadamard transform (docs/math.md §4.6) and RMSNorm (docs/math.md §3) tests against scalar-loop oracles.

Tolerance: fp64 vs fp64 oracle, rtol 1e-10 / atol 1e-12 (rounding-order differences only).
"""

import math

import pytest
import torch

from megatron_dsa.ops.hadamard import hadamard_transform
from megatron_dsa.ops.norms import rms_norm
from oracles import hadamard_vector_oracle, rms_norm_vector_oracle, sylvester_hadamard

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def _sylvester_matrix(n: int) -> torch.Tensor:
    return torch.tensor(sylvester_hadamard(n), dtype=F64) / math.sqrt(n)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 64])
def test_hadamard_equals_explicit_sylvester_matrix(n):
    x = torch.randn(3, 5, n, dtype=F64)
    torch.testing.assert_close(hadamard_transform(x), x @ _sylvester_matrix(n).T, **TOL)


def test_hadamard_matches_scalar_oracle_and_sylvester_order():
    x = torch.randn(4, 8, dtype=F64)
    expected = torch.stack([hadamard_vector_oracle(row) for row in x])
    torch.testing.assert_close(hadamard_transform(x), expected, **TOL)
    # Sylvester (natural) order: basis vector e_1 maps to row 1 of H_8 = [+,−,+,−,+,−,+,−]/sqrt(8).
    e1 = torch.zeros(8, dtype=F64)
    e1[1] = 1.0
    torch.testing.assert_close(hadamard_transform(e1), torch.tensor([1., -1.] * 4, dtype=F64) / math.sqrt(8), **TOL)


@pytest.mark.parametrize("n", [2, 16, 128])
def test_hadamard_is_orthonormal_and_self_inverse(n):
    eye = torch.eye(n, dtype=F64)
    h = hadamard_transform(eye)
    torch.testing.assert_close(h @ h.T, eye, **TOL)
    x = torch.randn(6, n, dtype=F64)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x)), x, **TOL)
    torch.testing.assert_close(hadamard_transform(x).norm(dim=-1), x.norm(dim=-1), **TOL)


@pytest.mark.parametrize("n", [0, 3, 6, 12, 100])
def test_hadamard_rejects_non_power_of_two(n):
    with pytest.raises(ValueError):
        hadamard_transform(torch.randn(2, n, dtype=F64))


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "weightless"])
def test_rms_norm_matches_oracle(weighted):
    eps = 1e-6
    x = torch.randn(4, 3, 10, dtype=F64) * torch.tensor([0.01, 1.0, 30.0], dtype=F64).view(1, 3, 1)
    weight = torch.randn(10, dtype=F64) if weighted else None
    got = rms_norm(x, weight, eps)
    expected = torch.stack([torch.stack([rms_norm_vector_oracle(v, weight, eps) for v in row]) for row in x])
    assert got.dtype == F64
    torch.testing.assert_close(got, expected, **TOL)


def test_rms_norm_eps_matters_for_tiny_inputs():
    """eps sits inside the root: a 1e-4-scale row is shrunk noticeably with eps = 1e-6."""
    x = torch.full((1, 4), 1e-4, dtype=F64)
    got = rms_norm(x, None, 1e-6)
    torch.testing.assert_close(got, x / math.sqrt(1e-8 + 1e-6), **TOL)


def test_rms_norm_grads_match_oracle_autograd():
    x = torch.randn(3, 6, dtype=F64, requires_grad=True)
    w = torch.randn(6, dtype=F64, requires_grad=True)
    g = torch.randn(3, 6, dtype=F64)
    got = torch.autograd.grad((rms_norm(x, w, 1e-5) * g).sum(), (x, w))
    oracle = torch.stack([rms_norm_vector_oracle(row, w, 1e-5) for row in x])
    expected = torch.autograd.grad((oracle * g).sum(), (x, w))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL)
