"""Indexer KL loss (docs/math.md §8; bug classes A2.2, A2.3, A3.1).

The oracle (`indexer_loss_oracle`) builds the teacher from the full denominator
`exp(sink) + Σ_window + Σ_candidates`, head-sums, L1-normalises, and takes a loop KL against the
student softmax over the valid candidates. Tolerance: fp64 op vs fp64 oracle rtol 1e-10 / atol 1e-12
(summation order only); the float32 tiny-mass case uses rtol 1e-6 (float32 rounding).
"""

import math

import pytest
import torch

import megatron_dsa.ops.sparse_attention as sparse_module
from megatron_dsa.ops.indexer import indexer_scores
from megatron_dsa.ops.indexer_loss import indexer_kl_backward, kl_per_row, reduce_indexer_loss, teacher_target
from megatron_dsa.ops.indices import (offset_valid, topk_columns, visible_compressed_indices,
                                      window_indices)
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.sparse_attention import full_normaliser, sparse_attention
from oracles import INVALID, indexer_loss_oracle, kl_rows_oracle, pick_columns, teacher_target_oracle

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
SCALE = 0.45
COEFF = 0.3
WINDOW, RATIO, TOPK = 3, 4, 2


class Problem:
    """One sequence of 13 tokens, r = 4 (3 compressed entries), window 3; kv_full = [tokens; entries]."""

    def __init__(self, seed=0, heads=2, dim=4):
        gen = torch.Generator().manual_seed(seed)
        layout = TokenLayout.uniform(1, 13, torch.device("cpu"))
        clayout = layout.compressed(RATIO)
        self.rows = layout.num_rows
        self.query = torch.randn(self.rows, heads, dim, generator=gen, dtype=F64)
        self.kv = torch.randn(self.rows + clayout.capacity, dim, generator=gen, dtype=F64)
        self.sink = torch.tensor([2.0, -1.5][:heads], dtype=F64)
        self.window = window_indices(layout, WINDOW)
        self.visible = offset_valid(visible_compressed_indices(clayout), self.rows)  # kv_full rows
        raw = torch.randn(self.visible.shape, generator=gen, dtype=F64)
        self.scores = raw.masked_fill(self.visible < 0, float("-inf")).requires_grad_()  # indexer-like

    def dense(self):
        """(candidates, student scores) for the dense loss: all visible entries."""
        return self.visible, self.scores

    def sparse(self):
        """(candidates, student scores) for the sparse loss: the top-k of the student's scores
        (the gathered student is its own leaf, so gradients are taken with respect to it)."""
        columns = topk_columns(self.scores, self.visible >= 0, TOPK)
        student = torch.gather(self.scores.detach(), 1, columns.clamp_min(0))
        return pick_columns(self.visible, columns), student.requires_grad_()

    def full_lse(self, candidates, sparse):
        if sparse:  # the attention's own LSE (sink excluded) + the sink, as the layer does
            _, lse = sparse_attention(self.query, self.kv, torch.cat((self.window, candidates), 1), self.sink,
                                      SCALE)
            return torch.logaddexp(lse, self.sink)
        return full_normaliser(self.query, self.kv, torch.cat((self.window, candidates), 1), self.sink, SCALE)

    def package_loss(self, candidates, student, sparse, per_token, coeff=COEFF):
        target = teacher_target(self.query, self.kv, candidates, self.full_lse(candidates, sparse), SCALE)
        per_row = kl_per_row(student, target, candidates >= 0)
        return reduce_indexer_loss(per_row, coeff, per_token, self.rows), target

    def oracle_loss(self, candidates, student, per_token, coeff=COEFF, **denominator):
        return indexer_loss_oracle(self.query, self.kv, self.window.tolist(), candidates.tolist(),
                                   self.sink.tolist(), SCALE, student, coeff, per_token, **denominator)

    def oracle_target(self, candidates, **denominator):
        return torch.tensor(teacher_target_oracle(self.query, self.kv, self.window.tolist(), candidates.tolist(),
                                                  self.sink.tolist(), SCALE, **denominator), dtype=F64)


@pytest.mark.parametrize("per_token", [True, False], ids=["per_token_sum", "mean"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_loss_and_student_grads_match_oracle(mode, per_token):
    p = Problem(seed=1)
    candidates, student = getattr(p, mode)()
    assert (candidates >= 0).any(1).sum() < p.rows  # early rows have no candidate (count as 0)
    loss, target = p.package_loss(candidates, student, mode == "sparse", per_token)
    expected = p.oracle_loss(candidates, student, per_token)
    torch.testing.assert_close(target, p.oracle_target(candidates), **TOL)
    torch.testing.assert_close(loss, expected, **TOL)
    (grad,) = torch.autograd.grad(loss, student)
    (grad_ref,) = torch.autograd.grad(expected, student)
    torch.testing.assert_close(grad, grad_ref, **TOL)
    assert torch.all(torch.isfinite(grad))


def test_student_gradient_is_pred_minus_target():
    """docs/math.md §8.6: ∂loss/∂I(t,j) = (coeff/N)·(pred_j − target_j) on valid columns, 0 elsewhere."""
    p = Problem(seed=2)
    candidates, student = p.dense()
    loss, target = p.package_loss(candidates, student, sparse=False, per_token=False)
    (grad,) = torch.autograd.grad(loss, p.scores)
    valid = candidates >= 0
    pred = torch.softmax(student.detach(), dim=-1).nan_to_num(0.0)  # rows without candidates: no gradient
    expected = torch.where(valid, COEFF / p.rows * (pred - target), torch.zeros_like(pred))
    torch.testing.assert_close(grad, expected, **TOL)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_sum_over_rows_equals_mean_times_rows(mode):
    """A2.2: per-token (sum) / N == mean, and the gradients scale by exactly N."""
    p = Problem(seed=3)
    candidates, student = getattr(p, mode)()
    total, _ = p.package_loss(candidates, student, mode == "sparse", per_token=True)
    mean, _ = p.package_loss(candidates, student, mode == "sparse", per_token=False)
    torch.testing.assert_close(total / p.rows, mean, **TOL)
    (g_total,) = torch.autograd.grad(total, student)
    (g_mean,) = torch.autograd.grad(mean, student)
    torch.testing.assert_close(g_total, p.rows * g_mean, **TOL)


def test_reduce_indexer_loss_modes():
    per_row = torch.tensor([0.5, 0.0, 1.5, 2.0], dtype=F64)
    assert float(reduce_indexer_loss(per_row, 0.1, True, 4)) == pytest.approx(0.4, rel=1e-14)
    assert float(reduce_indexer_loss(per_row, 0.1, False, 4)) == pytest.approx(0.1, rel=1e-14)
    assert float(reduce_indexer_loss(per_row[:0], 0.1, False, 0)) == 0.0  # no rows: 0, not NaN


def test_teacher_is_detached():
    p = Problem(seed=4)
    query, kv = p.query.clone().requires_grad_(), p.kv.clone().requires_grad_()
    candidates, _ = p.dense()
    lse = full_normaliser(query, kv, torch.cat((p.window, candidates), 1), p.sink, SCALE)
    target = teacher_target(query, kv, candidates, lse, SCALE)
    assert not target.requires_grad and not lse.requires_grad


def test_masked_minus_inf_student_positions_match_trimmed_row():
    """A3.1 / docs/math.md §8.3: −inf at masked columns gives a finite loss equal to the loss on the trimmed row,
    and a finite gradient that is exactly 0 at the masked columns."""
    student = torch.tensor([[0.2, float("-inf"), -1.0, float("-inf"), 0.7]], dtype=F64, requires_grad=True)
    valid = torch.isfinite(student.detach())
    target = torch.tensor([[0.5, 0.0, 0.2, 0.0, 0.3]], dtype=F64)
    loss = kl_per_row(student, target, valid).sum()
    trimmed = student.detach()[valid].view(1, -1).requires_grad_()
    trimmed_loss = kl_per_row(trimmed, target[valid].view(1, -1), torch.ones(1, 3, dtype=torch.bool)).sum()
    oracle = kl_rows_oracle(trimmed, target[valid].view(1, -1).tolist(), [[True] * 3])[0]
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, trimmed_loss, **TOL)
    torch.testing.assert_close(loss, oracle, **TOL)
    (grad,) = torch.autograd.grad(loss, student)
    (grad_trimmed,) = torch.autograd.grad(oracle, trimmed)
    assert torch.all(torch.isfinite(grad)) and torch.equal(grad[~valid], torch.zeros(2, dtype=F64))
    torch.testing.assert_close(grad[valid], grad_trimmed[0], **TOL)


def test_minus_inf_student_with_zero_target_contributes_zero():
    """A3.1 (Megatron #5018 shape): a column the caller marks valid whose student score is −inf and whose
    target is 0 must add 0 (0·log 0 = 0), not 0·(+inf) = NaN; its gradient is 0."""
    student = torch.tensor([[0.5, float("-inf"), -0.5]], dtype=F64, requires_grad=True)
    target = torch.tensor([[0.6, 0.0, 0.4]], dtype=F64)
    loss = kl_per_row(student, target, torch.ones(1, 3, dtype=torch.bool)).sum()
    finite = torch.tensor([[0.5, -0.5]], dtype=F64)
    expected = kl_rows_oracle(finite, [[0.6, 0.4]], [[True, True]])[0]
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected, **TOL)
    (grad,) = torch.autograd.grad(loss, student)
    assert torch.all(torch.isfinite(grad)) and float(grad[0, 1]) == 0.0


def test_rows_without_candidates_give_zero_loss_and_grad():
    student = torch.full((2, 3), float("-inf"), dtype=F64, requires_grad=True)
    per_row = kl_per_row(student, torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(per_row, torch.zeros(2, dtype=F64))
    (grad,) = torch.autograd.grad(per_row.sum(), student)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_denominator_regression_with_negative_control():
    """A2.3 / docs/math.md §8.2 (guards #5960/#6349): one row, 3 compressed keys, 2 window keys, sink = +2, two heads.
    The package equals the full-denominator oracle, and dropping the window or the sink from the
    teacher denominator changes the loss by more than 1e-3 (so the check has power)."""
    kv = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 2.0], [1.0, 1.0]], dtype=F64)  # 2 window, 3 comp.
    query = torch.tensor([[[2.0, 0.5], [-1.0, 0.3]]], dtype=F64)  # head 0 window-heavy, head 1 sink-heavy
    sink = torch.tensor([2.0, 2.0], dtype=F64)
    window, candidates = torch.tensor([[0, 1]]), torch.tensor([[2, 3, 4]])
    student = torch.tensor([[0.1, 0.5, -0.3]], dtype=F64)
    full_lse = full_normaliser(query, kv, torch.cat((window, candidates), 1), sink, 1.0)
    target = teacher_target(query, kv, candidates, full_lse, 1.0)
    loss = kl_per_row(student, target, candidates >= 0).sum()

    def oracle(**denominator):
        return float(indexer_loss_oracle(query, kv, window.tolist(), candidates.tolist(), sink.tolist(), 1.0,
                                         student, 1.0, True, **denominator))

    assert float(loss) == pytest.approx(oracle(), rel=1e-10, abs=1e-12)
    # hand check of the full normaliser: log(e^sink + Σ_window + Σ_compressed) per head
    for h in range(2):
        logits = [float(query[0, h] @ kv[k]) for k in range(5)]
        assert float(full_lse[0, h]) == pytest.approx(math.log(math.exp(2.0) + sum(map(math.exp, logits))), rel=1e-12)
    assert abs(oracle(include_window=False) - oracle()) > 1e-3
    assert abs(oracle(include_sink=False) - oracle()) > 1e-3
    assert abs(oracle(include_window=False, include_sink=False) - oracle()) > 1e-3


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_tiny_positive_mass_normalises_to_one(dtype, rtol):
    """docs/math.md §8.2: head-summed masses [1e-30, 2e-30] normalise to [1/3, 2/3] (clamp at float32 tiny only)."""
    query = torch.ones(1, 1, 1, dtype=dtype)
    kv = torch.tensor([[0.0], [math.log(2.0)]], dtype=dtype)
    full_lse = torch.tensor([[-math.log(1e-30)]], dtype=dtype)
    target = teacher_target(query, kv, torch.tensor([[0, 1]]), full_lse, 1.0)
    torch.testing.assert_close(target, torch.tensor([[1 / 3, 2 / 3]], dtype=dtype), rtol=rtol, atol=0)
    assert teacher_target_oracle(query.double(), kv.double(), [[]], [[0, 1]], [0.0], 1.0) != [[0.0, 0.0]]


def test_teacher_chunking_is_exact(monkeypatch):
    p = Problem(seed=5)
    candidates, _ = p.dense()
    lse = full_normaliser(p.query, p.kv, torch.cat((p.window, candidates), 1), p.sink, SCALE)
    reference = teacher_target(p.query, p.kv, candidates, lse, SCALE)
    monkeypatch.setattr(sparse_module, "CHUNK_ELEMENTS", 1)
    assert torch.equal(teacher_target(p.query, p.kv, candidates, lse, SCALE), reference)
    assert torch.equal(full_normaliser(p.query, p.kv, torch.cat((p.window, candidates), 1), p.sink, SCALE), lse)


def test_invalid_candidates_get_zero_target_and_rows_sum_to_one():
    p = Problem(seed=6)
    candidates, _ = p.sparse()
    target = teacher_target(p.query, p.kv, candidates, p.full_lse(candidates, True), SCALE)
    assert torch.equal(target[candidates < 0], torch.zeros_like(target[candidates < 0]))
    has = (candidates >= 0).any(1)
    torch.testing.assert_close(target[has].sum(1), torch.ones(int(has.sum()), dtype=F64), **TOL)
    assert torch.equal(target[~has], torch.zeros_like(target[~has]))
    assert INVALID in candidates.tolist()[0]


@pytest.mark.parametrize("with_zero_mass", [False, True])
def test_indexer_kl_backward_equals_autograd_through_scores_and_kl(with_zero_mass):
    """The `indexer_kl_bwd` reference (closed-form KL gradient, then the scores backward) equals
    autograd through `indexer_scores` and `kl_per_row` for a weighted row sum, with invalid slots, a
    row without candidates, zero-mass valid slots and a zero-weight (padding) row."""
    gen = torch.Generator().manual_seed(3)
    rows, heads, dim, keys, width = 9, 3, 4, 7, 5
    q = torch.randn(rows, heads, dim, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(keys, dim, generator=gen, dtype=F64, requires_grad=True)
    weights = torch.randn(rows, heads, generator=gen, dtype=F64, requires_grad=True)
    candidates = torch.randint(0, keys, (rows, width), generator=gen)
    candidates[:, -1] = INVALID
    candidates[4] = INVALID  # no candidate at all
    mass = torch.rand(rows, width, generator=gen, dtype=F64) * (candidates >= 0)
    if with_zero_mass:
        mass[1, :2] = 0.0
    target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)
    grad_rows = torch.rand(rows, generator=gen, dtype=F64)
    grad_rows[7] = 0.0

    student = indexer_scores(q, k, weights, candidates, SCALE)
    loss = (kl_per_row(student, target, candidates >= 0) * grad_rows).sum()
    expected = torch.autograd.grad(loss, (q, k, weights))
    got = indexer_kl_backward(q.detach(), k.detach(), weights.detach(), candidates, target,
                              student.detach(), grad_rows, SCALE)
    for name, a, b in zip(("q", "k", "weights"), got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=name)
