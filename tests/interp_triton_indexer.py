"""Triton lightning-indexer kernels in the CPU interpreter vs the unfused reference.

Run by `test_triton_indexer.py::test_interpreted_kernels` in a child process with
`TRITON_INTERPRET=1` (see `triton_support.py`). float32, tiny shapes; every comparison is against the
reference on the same float32 inputs, so only the order of float32 additions differs (≤ 33
candidates, ≤ 16 heads, ≤ 32 dims): rtol 1e-5 / atol 1e-5 for scores and grads.
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels import indexer as triton_indexer
from megatron_dsa.ops.indexer import indexer_scores as reference_scores
from megatron_dsa.ops.indexer_loss import indexer_kl_backward as reference_kl_backward
from indexer_cases import SCALE, causal_candidates, inputs, packed_candidates, random_candidates, run

from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")

TOL = dict(rtol=1e-5, atol=1e-5)


def _assert_matches_reference(q, k, w, cand, upstream=None):
    upstream = torch.randn(cand.shape) if upstream is None else upstream
    got, got_grads = run(triton_indexer.indexer_scores, q, k, w, cand, upstream)
    ref, ref_grads = run(reference_scores, q, k, w, cand, upstream)
    assert got.dtype == torch.float32 and got.shape == cand.shape
    invalid = cand < 0
    assert torch.isneginf(got[invalid]).all() and torch.isfinite(got[~invalid]).all()
    torch.testing.assert_close(got[~invalid], ref[~invalid], **TOL)
    for name, a, b in zip(("q", "k", "weights"), got_grads, ref_grads):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"grad {name}: {m}")
    return got, got_grads


@pytest.mark.parametrize("tokens,heads,dim,width", [(8, 1, 16, 5), (17, 4, 32, 16), (24, 16, 16, 33)])
def test_random_candidates_match_reference(tokens, heads, dim, width):
    q, k, w = inputs(tokens, heads, dim, entries=11)
    _assert_matches_reference(q, k, w, random_candidates(tokens, width, 11))


def test_causal_range_candidates_match_reference(monkeypatch):
    """Several forward row blocks; in backward every row adds its share of each key's gradient."""
    monkeypatch.setattr(triton_indexer, "FORWARD_ROWS", 16)
    q, k, w = inputs(24, 4, 16, entries=6)
    _assert_matches_reference(q, k, w, causal_candidates(24, 6).to(torch.int32))


def test_keys_without_grad_still_give_query_and_weight_grads():
    """k not requiring grad: the backward skips the key gradient, dq and dweights stay exact."""
    q, k, w = inputs(17, 4, 16, entries=9)
    k = k.detach()
    cand = random_candidates(17, 20, 9)
    upstream = torch.randn(cand.shape)
    scores = triton_indexer.indexer_scores(q, k, w, cand, SCALE)
    got = torch.autograd.grad((scores.masked_fill(cand < 0, 0) * upstream).sum(), (q, w))
    ref_scores = reference_scores(q, k, w, cand, SCALE)
    ref = torch.autograd.grad((ref_scores.masked_fill(cand < 0, 0) * upstream).sum(), (q, w))
    for name, a, b in zip(("q", "weights"), got, ref):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("lengths", [(10, 14), (4, 9, 11), (7, 3, 6, 8)])
@pytest.mark.parametrize("forward_rows", [16, 64])
def test_packed_sequences_match_reference(monkeypatch, lengths, forward_rows):
    """Tiles touching one or two sequences score each run of `base + j` ids with shared keys; tiles
    touching more (three or four short sequences in 64 rows) go row by row. Both agree with the
    reference, and the runs of one tile do not mix their keys."""
    monkeypatch.setattr(triton_indexer, "FORWARD_ROWS", forward_rows)
    tokens = sum(lengths)
    cand = packed_candidates(lengths)
    q, k, w = inputs(tokens, 4, 16, entries=int(cand.max()) + 2)
    _assert_matches_reference(q, k, w, cand)


def test_calls_beyond_the_grid_launch_per_slice_of_rows(monkeypatch):
    """More row blocks than the grid's second axis holds: one launch per slice of rows, same scores."""
    monkeypatch.setattr(triton_indexer, "FORWARD_ROWS", 16)
    monkeypatch.setattr(triton_indexer, "MAX_ROW_BLOCKS", 2)
    cand = packed_candidates((30, 45))
    q, k, w = inputs(75, 4, 16, entries=int(cand.max()) + 1)
    _assert_matches_reference(q, k, w, cand)


def test_invalid_rows_give_neg_inf_and_zero_grads_even_with_nan_upstream():
    """A row without candidates (e.g. the first tokens of a sequence) scores −inf everywhere; NaN
    upstream gradients at invalid slots (a softmax over an all −inf row) must not leak."""
    q, k, w = inputs(9, 4, 16, entries=7)
    cand = random_candidates(9, 16, 7)
    upstream = torch.randn(cand.shape).masked_fill(cand < 0, float("nan"))
    got, (dq, _, dw) = _assert_matches_reference(q, k, w, cand, upstream)
    assert torch.isneginf(got[1]).all()
    assert torch.equal(dq[1], torch.zeros_like(dq[1])) and torch.equal(dw[1], torch.zeros_like(dw[1]))


def test_relu_boundary_dot_exactly_zero():
    """A zero key row gives dots exactly 0: ReLU'(0) = 0, so that key gets an exactly zero gradient
    and contributes nothing to dq (a `>=` in place of `>` would give Σ g·w·q there)."""
    q, k, w = inputs(10, 4, 16, entries=5)
    with torch.no_grad():
        k[3] = 0.0
    cand = random_candidates(10, 16, 5)
    cand[:, 0] = 3
    _, (_, dk, _) = _assert_matches_reference(q, k, w, cand)
    assert torch.equal(dk[3], torch.zeros_like(dk[3]))


def test_inputs_are_not_mutated():
    q, k, w = inputs(12, 4, 16, entries=6)
    cand = random_candidates(12, 16, 6)
    before = [t.detach().clone() for t in (q, k, w, cand)]
    run(triton_indexer.indexer_scores, q, k, w, cand, torch.randn(cand.shape))
    for name, old, new in zip(("q", "k", "weights", "candidates"), before, (q, k, w, cand)):
        assert torch.equal(old, new), name


@pytest.mark.parametrize("width,statistics_slots", [(5, 1024), (33, 1024), (33, 16)])
def test_kl_backward_matches_reference(monkeypatch, width, statistics_slots):
    """The KL gradient formed in the kernel equals the reference (closed-form KL gradient, then the scores
    backward): −1 slots, a row without candidates, valid slots without target mass, a zero-weight row, and
    student scores around 1e4 (a softmax without its running maximum overflows), and a negative target
    entry, which the reference leaves out of the row's mass. With 16 statistics slots, the softmax
    statistics take three steps per row."""
    monkeypatch.setattr(triton_indexer, "KL_STATISTICS_SLOTS", statistics_slots)
    q, k, w = (t.detach() for t in inputs(13, 4, 16, entries=9))
    cand = random_candidates(13, width, 9)
    gen = torch.Generator().manual_seed(4)
    student = reference_scores(q, k, w, cand, SCALE) + 1e4
    mass = torch.rand(cand.shape, generator=gen) * (cand >= 0)
    mass[3, (cand[3] >= 0).nonzero()[0]] = 0.0  # a valid slot without mass
    target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    target[6] = torch.where(cand[6] >= 0, -0.5, target[6])
    grad_rows = torch.rand(13, generator=gen)
    grad_rows[5] = 0.0
    got = triton_indexer.indexer_kl_backward(q, k, w, cand, target, student, grad_rows, SCALE)
    expected = reference_kl_backward(q, k, w, cand, target, student, grad_rows, SCALE)
    for name, a, b in zip(("q", "k", "weights"), got, expected):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"grad {name}: {m}")
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))  # row 1 has no candidate


def test_kl_backward_rejects_bad_inputs():
    q, k, w = (t.detach() for t in inputs(4, 2, 16, entries=3))
    cand = random_candidates(4, 5, 3)
    fn = triton_indexer.indexer_kl_backward
    with pytest.raises(ValueError, match="must match candidates"):
        fn(q, k, w, cand, torch.zeros(4, 6), torch.zeros(4, 5), torch.ones(4), SCALE)
    with pytest.raises(ValueError, match="grad_rows"):
        fn(q, k, w, cand, torch.zeros(4, 5), torch.zeros(4, 5), torch.ones(3), SCALE)
    with pytest.raises(ValueError, match="share one device"):
        fn(q, k, w, cand, torch.zeros(4, 5, device="meta"), torch.zeros(4, 5), torch.ones(4), SCALE)


def test_invalid_inputs_raise():
    q, k, w = inputs(4, 2, 16, entries=3)
    cand = random_candidates(4, 5, 3)
    fn = triton_indexer.indexer_scores
    with pytest.raises(ValueError, match="q \\[T, HI, DI\\]"):
        fn(q[0], k, w, cand, SCALE)
    with pytest.raises(ValueError, match="do not match q"):
        fn(q, k, w[:3], cand, SCALE)
    with pytest.raises(TypeError, match="one dtype"):
        fn(q.double(), k.double(), w, cand, SCALE)
    with pytest.raises(TypeError, match="candidates must be int32 or int64"):
        fn(q, k, w, cand.float(), SCALE)
    with pytest.raises(ValueError, match="at most 2147483647 key rows"):
        fn(q, k[:1].expand(2**31, -1), w, cand, SCALE)
