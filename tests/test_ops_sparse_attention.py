"""Sparse attention with a learnable sink (docs/math.md §7; bug classes A2.5, A3.2, A4.2, A4.4, A8.2).

Reference: the dense masked scalar-loop oracle (`sparse_attention_oracle`), differentiated by autograd.
Tolerances: fp64 op vs fp64 oracle (values and gradients) rtol 1e-10 / atol 1e-12 — summation order
only; `gradcheck` uses eps 1e-6 with its default fp64 tolerances (tier T1). Sentinel and chunking
checks compare the op with itself: masked slots must not change a single bit, chunking at most the
summation order of the KV scatter-add (rtol 1e-13).
"""

import math

import pytest
import torch

import megatron_dsa.ops.sparse_attention as sparse_module
from megatron_dsa.ops.sparse_attention import full_normaliser, sparse_attention
from oracles import INVALID, sparse_attention_oracle

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
INT32_MAX = 2 ** 31 - 1
SINK = (4.0, -4.0)  # far from 0 so a dropped or mis-signed sink term is visible (A2.5)


def make_problem(rows=7, heads=2, dim=6, num_kv=10, width=5, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, dim, generator=gen, dtype=F64).to(dtype).requires_grad_()
    kv = torch.randn(num_kv, dim, generator=gen, dtype=F64).to(dtype).requires_grad_()
    sink = torch.tensor([SINK[h % 2] for h in range(heads)], dtype=torch.float32, requires_grad=True)
    indices = torch.stack([torch.randperm(num_kv, generator=gen)[:width] for _ in range(rows)])
    indices[torch.rand(rows, width, generator=gen) < 0.3] = INVALID  # distinct valid ids per row
    return query, kv, indices, sink


def finite_lse(lse):
    """−inf (empty rows) → 0 so that a loss using the LSE stays finite."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def out_lse_loss(out, lse, seed=9):
    """Upstream gradients into both outputs: `Σ out·g + Σ lse·h` (A2.5)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)
    h = torch.randn(lse.shape, generator=gen, dtype=F64).to(lse.dtype)
    return (out * g).sum() + (finite_lse(lse) * h).sum()


def grads(query, kv, sink, loss):
    return torch.autograd.grad(loss, (query, kv, sink))


def test_forward_matches_dense_masked_oracle():
    query, kv, indices, sink = make_problem()
    scale = query.shape[-1] ** -0.5
    out, lse = sparse_attention(query, kv, indices, sink, scale)
    out_ref, lse_ref = sparse_attention_oracle(query, kv, indices.tolist(), sink.double(), scale)
    assert out.dtype == F64 and lse.dtype == F64 and out.shape == query.shape and lse.shape == query.shape[:2]
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)


def test_lse_is_natural_log_without_sink():
    query, kv, indices, sink = make_problem(rows=3, seed=1)
    indices[:, 1:] = INVALID
    indices[:, 0] = torch.tensor([2, 5, 7])
    _, lse = sparse_attention(query, kv, indices, sink, 0.5)
    for t, key in enumerate([2, 5, 7]):
        for h in range(query.shape[1]):
            logit = 0.5 * float(query[t, h].detach() @ kv[key].detach())
            assert math.isclose(float(lse[t, h].detach()), logit, rel_tol=1e-12, abs_tol=1e-12)


def test_gradients_with_out_and_lse_loss_match_oracle_autograd():
    """dq, dkv (K = V tied, scatter-add over rows and heads) and d_sink, sink = ±4."""
    query, kv, indices, sink = make_problem(seed=2)
    indices[3] = indices[2]  # two rows sharing keys: the KV gradient must accumulate
    scale = 0.41
    got = grads(query, kv, sink, out_lse_loss(*sparse_attention(query, kv, indices, sink, scale)))
    sink64 = sink.double()
    expected = torch.autograd.grad(
        out_lse_loss(*sparse_attention_oracle(query, kv, indices.tolist(), sink64, scale)), (query, kv, sink))
    dq, dkv, dsink = got
    torch.testing.assert_close(dq, expected[0], **TOL)
    torch.testing.assert_close(dkv, expected[1], **TOL)
    # the sink parameter is float32: its gradient is rounded once to float32
    assert dsink.dtype == torch.float32
    torch.testing.assert_close(dsink, expected[2], rtol=1e-6, atol=1e-7)
    assert torch.all(dsink.abs() > 1e-4)  # the sink really is trained


def test_sink_gradient_formula():
    """`∂L/∂sink_h = −Σ_t p_sink(t,h)·<dO[t,h], O[t,h]>` (docs/math.md §7.3), out-only loss, fp64 sink."""
    query, kv, indices, _ = make_problem(seed=3)
    sink = torch.tensor([4.0, -4.0], dtype=F64, requires_grad=True)
    out, lse = sparse_attention(query, kv, indices, sink, 0.3)
    d_out = torch.randn(out.shape, dtype=F64)
    (d_sink,) = torch.autograd.grad((out * d_out).sum(), sink)
    p_sink = torch.exp(sink.detach() - torch.logaddexp(lse.detach(), sink.detach()))
    expected = -(p_sink * (d_out * out.detach()).sum(-1)).sum(0)
    torch.testing.assert_close(d_sink, expected, **TOL)


def test_fully_masked_rows_give_zero_output_and_finite_zero_grads():
    """A3.2 / docs/math.md §7.2: no valid key ⇒ out 0, lse −inf, and no NaN anywhere in the backward."""
    query, kv, indices, sink = make_problem(seed=4)
    masked = [1, 4]
    indices[masked] = INVALID
    out, lse = sparse_attention(query, kv, indices, sink, 0.5)
    assert torch.equal(out[masked], torch.zeros_like(out[masked]))
    assert torch.all(torch.isneginf(lse[masked])) and torch.all(torch.isfinite(lse[[0, 2, 3, 5, 6]]))
    dq, dkv, dsink = grads(query, kv, sink, out_lse_loss(out, lse))
    for g in (dq, dkv, dsink):
        assert torch.all(torch.isfinite(g))
    assert torch.equal(dq[masked], torch.zeros_like(dq[masked]))
    # a problem made only of masked rows: every gradient is exactly zero
    out, lse = sparse_attention(query[masked], kv, indices[masked], sink, 0.5)
    for g in grads(query, kv, sink, out_lse_loss(out, lse)):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_out_of_range_sentinels_are_all_masked(index_dtype):
    """A4.4: −1, M, M+7 and INT32_MAX are all 'no key', in forward and backward, bit for bit."""
    query, kv, indices, sink = make_problem(seed=5)
    num_kv = kv.shape[0]
    mixed = indices.clone()
    slots = (mixed == INVALID).nonzero()
    sentinels = torch.tensor([INVALID, num_kv, num_kv + 7, INT32_MAX])
    mixed[slots[:, 0], slots[:, 1]] = sentinels[torch.arange(len(slots)) % 4]
    assert set(mixed[mixed < 0].tolist() + mixed[mixed >= num_kv].tolist()) == set(sentinels.tolist())
    results = []
    for idx in (indices, mixed.to(index_dtype)):
        out, lse = sparse_attention(query, kv, idx, sink, 0.5)
        results.append((out, lse, *grads(query, kv, sink, out_lse_loss(out, lse))))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    out_ref, _ = sparse_attention_oracle(query, kv, mixed.tolist(), sink.double(), 0.5)
    torch.testing.assert_close(results[1][0], out_ref, **TOL)


def test_minus_one_slots_never_touch_kv_row_zero():
    """A4.2: row 0 is never a valid key but most slots are −1 ⇒ dkv[0] is exactly 0."""
    query, kv, _, sink = make_problem(seed=6)
    indices = torch.full((7, 6), INVALID)
    indices[:, 0] = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    indices[::2, 1] = 9
    out, lse = sparse_attention(query, kv, indices, sink, 0.5)
    dq, dkv, dsink = grads(query, kv, sink, out_lse_loss(out, lse))
    assert torch.equal(dkv[0], torch.zeros_like(dkv[0]))
    expected = torch.autograd.grad(
        out_lse_loss(*sparse_attention_oracle(query, kv, indices.tolist(), sink.double(), 0.5)), kv)[0]
    torch.testing.assert_close(dkv, expected, **TOL)


def test_all_ones_values_give_one_minus_sink_probability():
    """A8.2 with a sink: with K = V ≡ 1 every output channel equals Σ_k p_k = 1 − p_sink."""
    query, _, indices, sink = make_problem(seed=7)
    kv = torch.ones(10, 6, dtype=F64)
    out, _ = sparse_attention(query.detach(), kv, indices, sink.detach(), 0.5)
    count = (indices >= 0).sum(1, keepdim=True).double()  # n keys, all with logit s = 0.5·Σ q
    logit = 0.5 * query.detach().sum(-1)
    p_sink = torch.exp(sink.double()) / (torch.exp(sink.double()) + count * torch.exp(logit))
    torch.testing.assert_close(out, (1 - p_sink).unsqueeze(-1).expand_as(out), **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_output_dtype_and_float32_lse(dtype):
    query, kv, indices, sink = make_problem(seed=8, dtype=dtype)
    out, lse = sparse_attention(query, kv, indices, sink, 0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32
    dq, dkv, dsink = grads(query, kv, sink, out_lse_loss(out, lse))
    assert dq.dtype == dtype and dkv.dtype == dtype and dsink.dtype == torch.float32
    out_ref, lse_ref = sparse_attention_oracle(query.double(), kv.double(), indices.tolist(), sink.double(), 0.5)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 inputs/output rounding; fp32 accumulation
    torch.testing.assert_close(out.double(), out_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk_elements", [1, 70, 200])
def test_chunking_does_not_change_results(monkeypatch, chunk_elements):
    """Tiny CHUNK_ELEMENTS (1 row per chunk, and ragged chunks) vs the default single chunk."""
    query, kv, indices, sink = make_problem(rows=9, seed=10)
    indices[4] = INVALID

    def run():
        out, lse = sparse_attention(query, kv, indices, sink, 0.5)
        norm = full_normaliser(query, kv, indices, sink, 0.5)
        return (out, lse, norm, *grads(query, kv, sink, out_lse_loss(out, lse)))

    reference = run()
    monkeypatch.setattr(sparse_module, "CHUNK_ELEMENTS", chunk_elements)
    assert sparse_module._rows_per_chunk(indices.shape[1], 2, 6) < query.shape[0]
    chunked = run()
    for name, a, b in zip(("out", "lse", "normaliser", "dq", "dkv", "dsink"), reference, chunked):
        if name in ("out", "lse", "normaliser", "dq"):
            assert torch.equal(a, b), name  # row-local math: identical
        else:  # accumulated across chunks: only the summation order may change
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def test_full_normaliser_includes_the_sink():
    query, kv, indices, sink = make_problem(seed=11)
    indices[2] = INVALID
    _, lse = sparse_attention(query, kv, indices, sink, 0.5)
    norm = full_normaliser(query, kv, indices, sink, 0.5)
    torch.testing.assert_close(norm, torch.logaddexp(lse, sink.double()), **TOL)
    torch.testing.assert_close(norm[2], sink.double(), rtol=0, atol=0)  # empty row: sink only


def test_gradcheck_out_and_lse():
    query, kv, indices, _ = make_problem(rows=3, heads=2, dim=3, num_kv=5, width=3, seed=12)
    indices[:, 0] = torch.tensor([0, 3, 4])  # every row has at least one key: finite lse
    sink = torch.tensor([1.5, -2.0], dtype=F64, requires_grad=True)
    query, kv = query.detach().requires_grad_(), kv.detach().requires_grad_()

    def fn(q, k, s):
        return sparse_attention(q, k, indices, s, 0.7)

    assert torch.autograd.gradcheck(fn, (query, kv, sink), eps=1e-6)


def test_gradcheck_with_fully_masked_row():
    query, kv, indices, _ = make_problem(rows=3, heads=2, dim=3, num_kv=5, width=3, seed=13)
    indices[:, 0] = torch.tensor([1, 2, 4])
    indices[1] = INVALID
    sink = torch.tensor([4.0, -4.0], dtype=F64, requires_grad=True)
    query, kv = query.detach().requires_grad_(), kv.detach().requires_grad_()

    def fn(q, k, s):
        out, lse = sparse_attention(q, k, indices, s, 0.7)
        return out, finite_lse(lse)

    assert torch.autograd.gradcheck(fn, (query, kv, sink), eps=1e-6)


def test_input_validation():
    query, kv, indices, sink = make_problem()
    with pytest.raises(ValueError):
        sparse_attention(query, kv, indices, sink[:1], 0.5)
    with pytest.raises(TypeError):
        sparse_attention(query, kv, indices.double(), sink, 0.5)
    with pytest.raises(ValueError):
        sparse_attention(query, kv[:, :3], indices, sink, 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_logits_near_1e3_and_a_large_sink_stay_finite_and_exact(dtype):
    """exp(1000) overflows every float type: the op must subtract the row maximum (sink included).
    fp32 against the fp64 oracle: logits near 1e3 carry ~1e3 · 6e-8 absolute rounding, so 1e-3
    relative on the outputs; fp64 to the usual tolerance."""
    query, kv, indices, _ = make_problem(seed=3)
    with torch.no_grad():
        query.mul_(300.0)
    scale = query.shape[-1] ** -0.5
    sink = torch.tensor([900.0, -900.0], dtype=torch.float32, requires_grad=True)
    q, k = query.detach().to(dtype).requires_grad_(), kv.detach().to(dtype).requires_grad_()
    out, lse = sparse_attention(q, k, indices, sink, scale)
    out_ref, lse_ref = sparse_attention_oracle(query, kv, indices.tolist(), sink.double(), scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse[torch.isfinite(lse_ref)]).all()
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else TOL
    torch.testing.assert_close(out.double(), out_ref, **tol)
    torch.testing.assert_close(lse.double(), lse_ref, **tol)
    (out.double().sum() + finite_lse(lse).double().sum()).backward()
    assert all(torch.isfinite(g).all() for g in (q.grad, k.grad, sink.grad))
