"""Dense causal attention (GQA, qk dim != v dim, packed segments; bug classes A5.2, A5.7, A6.1) and the
grouped "wo_a" output projection (docs/math.md §10), against scalar-loop oracles.

Tolerance: fp64 op vs fp64 oracle (values and autograd gradients), rtol 1e-10 / atol 1e-12.
"""

import pytest
import torch

import megatron_dsa.ops.dense_attention as dense_module
from megatron_dsa.ops.dense_attention import causal_attention
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.output_projection import grouped_output_projection
from oracles import causal_attention_oracle, grouped_projection_oracle

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def packed(lengths) -> TokenLayout:
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.long)
    return TokenLayout(cu_seqlens=cu, num_rows=sum(lengths), max_seqlen=max(lengths))


def _qkv(tokens, heads, groups, dqk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dqk, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(tokens, groups, dqk, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(tokens, groups, dv, generator=gen, dtype=F64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("heads, groups, dqk, dv", [(4, 2, 5, 3), (4, 1, 3, 6), (2, 2, 4, 4)],
                         ids=["gqa", "mqa_dv_gt_dqk", "mha"])
@pytest.mark.parametrize("lengths", [[6], [4, 1, 5]], ids=["one_segment", "three_segments"])
def test_causal_attention_matches_oracle(lengths, heads, groups, dqk, dv):
    q, k, v = _qkv(sum(lengths), heads, groups, dqk, dv)
    scale = 0.6
    out, lse = causal_attention(q, k, v, packed(lengths), scale)
    out_ref, lse_ref = causal_attention_oracle(q, k, v, lengths, scale)
    assert out.shape == (sum(lengths), heads, dv) and out.dtype == F64 and lse.shape == (sum(lengths), heads)
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    upstream = torch.randn(out.shape, dtype=F64)
    h = torch.randn(lse.shape, dtype=F64)
    got = torch.autograd.grad((out * upstream).sum() + (lse * h).sum(), (q, k, v))
    expected = torch.autograd.grad((out_ref * upstream).sum() + (lse_ref * h).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"d{n}: {m}")


def test_packed_segments_equal_separate_calls():
    lengths = [3, 5, 2]
    q, k, v = _qkv(10, 4, 2, 4, 3, seed=1)
    together, _ = causal_attention(q, k, v, packed(lengths), 0.5)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        alone, _ = causal_attention(q[rows], k[rows], v[rows], packed([length]), 0.5)
        torch.testing.assert_close(together[rows], alone, **TOL)
        start += length


def test_first_token_of_each_segment_copies_its_value():
    lengths = [2, 3]
    q, k, v = _qkv(5, 2, 1, 3, 4, seed=2)
    out, lse = causal_attention(q, k, v, packed(lengths), 0.5)
    for first in (0, 2):
        torch.testing.assert_close(out[first], v[first].expand(2, 4), **TOL)
        torch.testing.assert_close(lse[first], 0.5 * (q[first] @ k[first, 0]), **TOL)


def test_chunked_rows_are_identical(monkeypatch):
    q, k, v = _qkv(9, 2, 1, 3, 3, seed=3)
    layout = packed([4, 5])
    reference = causal_attention(q, k, v, layout, 0.5)
    monkeypatch.setattr(dense_module, "CHUNK_ELEMENTS", 20)  # one query row per chunk
    for a, b in zip(reference, causal_attention(q, k, v, layout, 0.5)):
        assert torch.equal(a, b)


def test_causal_attention_rejects_mismatched_shapes():
    q, k, v = _qkv(4, 3, 2, 4, 4)
    with pytest.raises(ValueError):  # 3 heads do not split into 2 KV groups
        causal_attention(q, k, v, packed([4]), 0.5)


@pytest.mark.parametrize("heads, dim, groups, rank", [(4, 3, 2, 5), (8, 2, 8, 1), (2, 4, 1, 3)])
def test_grouped_output_projection_matches_loops(heads, dim, groups, rank):
    """Group g holds heads g·H/G … (g+1)·H/G − 1 (head-major, then dim) and uses weight rows g·Ro …"""
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    o = torch.randn(5, heads * dim, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(groups * rank, heads * dim // groups, generator=gen, dtype=F64, requires_grad=True)
    got = grouped_output_projection(o, w, groups)
    expected = grouped_projection_oracle(o, w, groups)
    assert got.shape == (5, groups * rank)
    torch.testing.assert_close(got, expected, **TOL)
    upstream = torch.randn(got.shape, dtype=F64)
    for a, b in zip(torch.autograd.grad((got * upstream).sum(), (o, w)),
                    torch.autograd.grad((expected * upstream).sum(), (o, w))):
        torch.testing.assert_close(a, b, **TOL)


def test_grouped_output_projection_keeps_leading_dims():
    o = torch.randn(3, 2, 12, dtype=F64)
    w = torch.randn(4 * 2, 6, dtype=F64)
    got = grouped_output_projection(o, w, 2)
    torch.testing.assert_close(got.reshape(6, 8), grouped_projection_oracle(o.reshape(6, 12), w, 2), **TOL)


def test_grouped_output_projection_rejects_bad_shapes():
    with pytest.raises(ValueError):
        grouped_output_projection(torch.randn(2, 10), torch.randn(6, 5), 3)


def test_causal_attention_function_gradcheck_and_chunking(monkeypatch):
    """The chunked recompute-in-backward Function: gradcheck through both outputs (out and lse),
    GQA (4 query heads on 2 KV heads), two segments; identical results with one-row chunks."""
    import megatron_dsa.ops.dense_attention as dense
    from megatron_dsa.ops.layout import TokenLayout

    torch.manual_seed(0)
    layout = TokenLayout(cu_seqlens=torch.tensor([0, 3, 7]), num_rows=7, max_seqlen=4)
    q = torch.randn(7, 4, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(7, 2, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(7, 2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: dense.causal_attention(q, k, v, layout, 0.7), (q, k, v))
    whole = dense.causal_attention(q, k, v, layout, 0.7)
    monkeypatch.setattr(dense, "CHUNK_ELEMENTS", 1)
    chunked = dense.causal_attention(q, k, v, layout, 0.7)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-14) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_block_gradcheck(causal):
    """The CP ring's block op (same chunked Function): gradcheck through out and lse, GQA."""
    from megatron_dsa.ops.dense_attention import attention_block

    torch.manual_seed(1)
    q = torch.randn(4, 4, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4 if causal else 6, 2, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(k.shape[0], 2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: attention_block(q, k, v, 0.6, causal), (q, k, v))


class LargestOutput(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any single op returned inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("groups", [1, 2])
def test_grouped_heads_share_their_kv_rows_without_per_head_copies(groups):
    """GQA/MQA: a KV group's heads read its K/V rows in place (one GEMM per group), forward and backward;
    nothing `[keys, H, D]`-sized is made (per-head copies of K and V were most of an M layer's memory at long
    sequences: 18 GB at 64k tokens). 8 query rows against 512 keys, 16 heads: a copy of K per head is 131072
    elements, every legitimate tensor (q, its gradient, one chunk's logits, K/V and their gradients) at most
    65536."""
    torch.manual_seed(2)
    q = torch.randn(8, 16, 16, requires_grad=True)
    k = torch.randn(512, groups, 16, requires_grad=True)
    v = torch.randn(512, groups, 16, requires_grad=True)
    from megatron_dsa.ops.dense_attention import attention_block

    with LargestOutput() as mode:
        out, lse = attention_block(q, k, v, 0.25, causal=False)
        (out.square().sum() + lse.sum()).backward()
    assert mode.largest <= 8 * 16 * 512, mode.largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_flags_and_stand_ins_of_non_finite_values(dtype):
    """`non_finite_heads` (from one min/max pass) flags exactly the head vectors `isfinite(t).all(-1)` does, NaN
    and both infinities alike, and an empty vector never; `finite_stand_in` zeroes exactly those elements."""
    non_finite_heads, finite_stand_in = dense_module.non_finite_heads, dense_module.finite_stand_in
    g = torch.Generator().manual_seed(4)
    t = torch.randn(40, 3, 17, generator=g).to(dtype)
    flat = t.view(-1)
    for value, count in ((float("nan"), 5), (float("inf"), 3), (float("-inf"), 3)):
        flat[torch.randint(0, flat.numel(), (count,), generator=g)] = value
    assert torch.equal(non_finite_heads(t), ~torch.isfinite(t).all(-1))
    assert non_finite_heads(t[..., :0]).shape == (40, 3) and not non_finite_heads(t[..., :0]).any()
    stand_in = finite_stand_in(t)
    assert torch.equal(stand_in, torch.where(torch.isfinite(t), t, torch.zeros((), dtype=dtype)))
