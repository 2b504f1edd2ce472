"""Triton indexer-loss kernels in the CPU interpreter vs the unfused reference.

Run by `test_triton_indexer_loss.py::test_interpreted_kernels` in a child process with
`TRITON_INTERPRET=1` (see `triton_support.py`). float32, tiny shapes; every comparison is against the
reference on the same float32 inputs, so only the order of float32 additions (≤ 32 dims, ≤ 16 heads,
≤ 33 columns; the KL's online per-lane softmax sum) and numpy vs torch exp/log differ: rtol 1e-5 with
atol 1e-6 for masses and gradients, atol 1e-5 for KL values (sums of up to 33 terms of size ≤ ~20).
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels import indexer_loss as triton_loss
from megatron_dsa.ops.indexer_loss import kl_per_row as reference_kl
from megatron_dsa.ops.indexer_loss import teacher_target
from saved_tensors import SavedTensorGuard
from indexer_cases import random_candidates
from indexer_loss_cases import SCALE, kl_inputs, mass_inputs, reference_mass, run_kl

from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")

MASS_TOL = dict(rtol=1e-5, atol=1e-6)
KL_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


def _assert_mass_matches(tokens, heads, dim, width, entries=11, index_dtype=torch.int64):
    cand = random_candidates(tokens, width, entries).to(index_dtype)
    query, kv, lse = mass_inputs(tokens, heads, dim, entries, cand)
    got = triton_loss.attention_mass(query, kv, cand, lse, SCALE)
    assert got.dtype == torch.float32 and got.shape == cand.shape and not got.requires_grad
    assert torch.equal(got[cand < 0], torch.zeros_like(got[cand < 0]))
    torch.testing.assert_close(got, reference_mass(query, kv, cand, lse), **MASS_TOL)
    return query, kv, cand, lse, got


@pytest.mark.parametrize("tokens,heads,dim,width", [(5, 1, 16, 3), (17, 4, 32, 16), (17, 16, 16, 33),
                                                    (5, 16, 32, 33)])
def test_mass_matches_reference(tokens, heads, dim, width):
    """−1 anywhere, a row without candidates (row 1), the same id three times in row 2."""
    _assert_mass_matches(tokens, heads, dim, width)


def test_mass_several_column_and_dim_blocks(monkeypatch):
    """16-column programs over 33 columns and 16-dim steps over 32 dims, int32 ids."""
    monkeypatch.setitem(triton_loss.MASS_TILES, torch.float32, (16, 16, 4, 1))
    _assert_mass_matches(17, 4, 32, 33, index_dtype=torch.int32)


def test_mass_normalised_is_the_teacher_target():
    """The op the layer completes in torch (L1 normalisation) gives `teacher_target`'s result."""
    query, kv, cand, lse, got = _assert_mass_matches(17, 4, 16, 16)
    normalised = got / got.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    torch.testing.assert_close(normalised, teacher_target(query, kv, cand, lse, SCALE), **MASS_TOL)


def test_mass_ids_past_kv_count_as_none():
    cand = random_candidates(5, 16, 11)
    query, kv, lse = mass_inputs(5, 4, 16, 11, cand)
    cand[0, :4] = kv.shape[0]
    got = triton_loss.attention_mass(query, kv, cand, lse, SCALE)
    assert torch.equal(got[0, :4], torch.zeros(4))
    torch.testing.assert_close(got, reference_mass(query, kv, cand, lse), **MASS_TOL)


def _assert_kl_matches(student, target, valid, upstream=None):
    upstream = torch.randn(valid.shape[0]) if upstream is None else upstream
    got, got_grad = run_kl(triton_loss.kl_per_row, student, target, valid, upstream)
    ref, ref_grad = run_kl(reference_kl, student, target, valid, upstream)
    assert got.dtype == torch.float32 and got.shape == (valid.shape[0],)
    assert torch.isfinite(got).all() and torch.isfinite(got_grad).all()
    torch.testing.assert_close(got, ref, **KL_TOL)
    torch.testing.assert_close(got_grad, ref_grad, **GRAD_TOL)
    assert torch.equal(got_grad[~valid], torch.zeros_like(got_grad[~valid]))
    return got, got_grad


@pytest.mark.parametrize("tokens,width", [(5, 3), (17, 16), (17, 33)])
def test_kl_matches_reference(tokens, width):
    """Random student, targets with exact zeros on valid columns, row 1 without valid columns."""
    got, grad = _assert_kl_matches(*kl_inputs(tokens, width))
    assert got[1] == 0 and torch.equal(grad[1], torch.zeros_like(grad[1]))


def test_kl_unnormalised_targets():
    """Rows whose target sums to 0.3 or 2 (the op does not assume Σ target = 1): the gradient's
    `pred·Σ target` term differs from `pred`."""
    student, target, valid = kl_inputs(17, 16)
    target[::2] *= 0.3
    target[1::4] *= 2.0
    _assert_kl_matches(student, target, valid)


def test_kl_several_column_blocks(monkeypatch):
    """16-column steps over 33 columns: the online max moves between steps (largest score last)."""
    monkeypatch.setattr(triton_loss, "KL_BLOCK_C", 16)
    student, target, valid = kl_inputs(17, 33)
    with torch.no_grad():
        student[:, 32] = 40.0
    _assert_kl_matches(student, target, valid)


@pytest.mark.parametrize("low,high", [(-1e30, 0.0), (0.0, 1e4), (-1e4, 1e4)])
def test_kl_extreme_student_scores(low, high):
    """Very negative scores (their pred underflows to 0, a positive target there gives a huge but
    finite term) and large ones (exp overflows without the max subtraction)."""
    student, target, valid = kl_inputs(17, 33)
    with torch.no_grad():
        student[:, ::3] = low
        student[:, 1::3] = high
    _assert_kl_matches(student, target, valid)


def test_kl_invalid_rows_ignore_nan_upstream():
    """A NaN upstream gradient of a row without valid columns (KL 0 there) gives zero gradient."""
    student, target, valid = kl_inputs(9, 16)
    valid[4] = False
    target[4] = 0.0
    upstream = torch.randn(9)
    upstream[[1, 4]] = float("nan")
    got, grad = _assert_kl_matches(student, target, valid, upstream)
    assert torch.equal(grad[[1, 4]], torch.zeros_like(grad[[1, 4]]))


def test_kl_all_zero_target_rows_give_zero():
    """Valid columns but no target mass (a row whose teacher mass underflowed): KL 0, gradient 0."""
    student, target, valid = kl_inputs(6, 16)
    target[3] = 0.0
    got, grad = _assert_kl_matches(student, target, valid)
    assert got[3] == 0 and torch.equal(grad[3], torch.zeros_like(grad[3]))


@pytest.mark.parametrize("tokens,width", [(0, 5), (4, 0)])
def test_empty_inputs(tokens, width):
    cand = torch.zeros(tokens, width, dtype=torch.int64)
    query, kv, lse = torch.zeros(tokens, 2, 16), torch.zeros(3, 16), torch.zeros(tokens, 2)
    assert triton_loss.attention_mass(query, kv, cand, lse, SCALE).shape == (tokens, width)
    student = torch.zeros(tokens, width, requires_grad=True)
    _assert_kl_matches(student, torch.zeros(tokens, width), torch.ones(tokens, width, dtype=torch.bool))


def test_kl_saves_through_save_for_backward():
    """Every tensor backward reads goes through `ctx.save_for_backward` (seen by saved-tensor hooks)
    and is unchanged when backward unpacks it (bug class A1.1)."""
    student, target, valid = kl_inputs(9, 16)
    with SavedTensorGuard().watching() as guard:
        kl = triton_loss.kl_per_row(student, target, valid)
    assert any(t is student for t in guard.tensors) and guard.packed == 6
    (grad,) = torch.autograd.grad(kl.sum(), (student,))
    assert guard.unpacked == 6
    assert torch.isfinite(grad).all()


def test_inputs_are_not_mutated():
    cand = random_candidates(9, 16, 11)
    query, kv, lse = mass_inputs(9, 4, 16, 11, cand)
    student, target, valid = kl_inputs(9, 16)
    tensors = (query, kv, cand, lse, student, target, valid)
    before = [t.detach().clone() for t in tensors]
    triton_loss.attention_mass(query, kv, cand, lse, SCALE)
    run_kl(triton_loss.kl_per_row, student, target, valid, torch.randn(9))
    for name, old, new in zip(("query", "kv", "candidates", "full_lse", "student", "target", "valid"),
                              before, tensors):
        assert torch.equal(old, new), name


def test_invalid_mass_inputs_raise():
    cand = random_candidates(4, 5, 3)
    query, kv, lse = mass_inputs(4, 2, 16, 3, cand)
    fn = triton_loss.attention_mass
    with pytest.raises(ValueError, match="query \\[T, H, D\\]"):
        fn(query[0], kv, cand, lse, SCALE)
    with pytest.raises(ValueError, match="do not match query"):
        fn(query, kv, cand[:3], lse, SCALE)
    with pytest.raises(ValueError, match="do not match query"):
        fn(query, kv, cand, lse[:, :1], SCALE)
    with pytest.raises(TypeError, match="one dtype"):
        fn(query.double(), kv.double(), cand, lse, SCALE)
    with pytest.raises(TypeError, match="full_lse must be float32"):
        fn(query, kv, cand, lse.double(), SCALE)
    with pytest.raises(TypeError, match="candidates must be int32 or int64"):
        fn(query, kv, cand.float(), lse, SCALE)


def test_invalid_kl_inputs_raise():
    student, target, valid = kl_inputs(4, 5)
    fn = triton_loss.kl_per_row
    with pytest.raises(ValueError, match="one shape"):
        fn(student, target[:3], valid)
    with pytest.raises(ValueError, match="one shape"):
        fn(student[0], target[0], valid[0])
    with pytest.raises(TypeError, match="float32 student_scores and target"):
        fn(student.double(), target, valid)
    with pytest.raises(TypeError, match="valid must be bool"):
        fn(student, target, valid.int())
