"""Triton dense attention (`backends/triton_kernels/dense_attention.py`) in the CPU interpreter against the unfused
reference (`ops.dense_attention`), float32: outputs, LSE and the q, k, v gradients for uniform batches, packed
segments with a capacity tail and a one-row segment, padded segments, GQA and MHA, head dims that need a tail
chunk or a masked one; the context-parallel ring's block ops (diagonal and earlier blocks, from a merged output
and LSE); non-finite isolation; and an `M` layer whose dense attention runs the kernels against the same layer
through the reference.

Not collected by the default suite: `test_triton_dense_attention.py` runs this file in a child process under the
interpreter (`triton_support.run_interpreted` says why). Tolerance: float32 kernels against the float32
reference differ only in summation order (blocked online softmax against whole-row logsumexp): atol 2e-5 /
rtol 1e-4 on values of order 1 (observed ~2e-6).
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import call_counts, reset_call_counts, variant_counts
from megatron_dsa.backends.triton_kernels import dense_attention as triton_dense
from megatron_dsa.ops.dense_attention import block_attention_backward, block_attention_forward, causal_attention
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.packed_seq import PackedSeqParams
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")
TOL = dict(atol=2e-5, rtol=1e-4)
CPU = torch.device("cpu")

LAYOUTS = {
    "uniform": lambda: TokenLayout.uniform(2, 19, CPU),
    # a one-row segment, and rows 33-39 past the last boundary (the last segment's capacity tail: padding
    # whose values the contract leaves open, `dense_layout`; the cases compare and train the real rows only)
    "packed_tail": lambda: TokenLayout.packed(torch.tensor([0, 14, 15, 33]), 40, CPU),
    # real lengths 9 and 12 in padded segments of 12 and 16
    "padded": lambda: TokenLayout.packed(torch.tensor([0, 9, 21]), 28, CPU,
                                         cu_seqlens_padded=torch.tensor([0, 12, 28])),
}


def qkv(rows: int, heads: int, groups: int, qk: int, v: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, heads, qk, generator=g), torch.randn(rows, groups, qk, generator=g),
            torch.randn(rows, groups, v, generator=g))


def attend_with_grads(fn, inputs, layout, upstream, scale=0.3):
    q, k, v = (t.clone().requires_grad_() for t in inputs)
    out, lse = fn(q, k, v, layout, scale)
    (out * upstream).sum().backward()
    return out, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("heads, groups, qk, v", [(4, 2, 24, 16), (3, 3, 40, 24), (2, 1, 16, 36)],
                         ids=["gqa_qk_tail", "mha_both_tails", "mqa_v_tail"])
def test_op_matches_reference(layout_name, heads, groups, qk, v):
    layout = LAYOUTS[layout_name]()
    inputs = qkv(layout.num_rows, heads, groups, qk, v)
    real = int(layout.cu_seqlens[-1])
    upstream = torch.randn(layout.num_rows, heads, v, generator=torch.Generator().manual_seed(1))
    upstream[real:] = 0
    reset_call_counts()
    got = attend_with_grads(triton_dense.dense_attention, inputs, layout, upstream)
    assert variant_counts()[("triton", "dense_attention", "portable")] == 1
    expected = attend_with_grads(causal_attention, inputs, layout, upstream)
    got, expected = ((out[:real], lse[:real], *grads) for out, lse, *grads in (got, expected))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("causal, n, m", [(True, 21, 21), (False, 21, 34), (False, 5, 3)],
                         ids=["diagonal", "earlier", "earlier_short"])
def test_block_ops_match_reference(causal, n, m):
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(n, 4, 24, generator=g), torch.randn(m, 2, 24, generator=g), torch.randn(m, 2, 20, generator=g)
    out, lse = triton_dense.block_forward(q, k, v, 0.3, causal)
    out_ref, lse_ref = block_attention_forward(q, k, v, 0.3, causal)
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    # Backward from a merged output and LSE (as if other blocks held part of the softmax mass).
    merged_out, merged_lse = out_ref * 0.6, lse_ref + 0.4
    grad_out = torch.randn(n, 4, 20, generator=g)
    got = triton_dense.block_backward(q, k, v, merged_out, merged_lse, grad_out, 0.3, causal)
    expected = block_attention_backward(q, k, v, merged_out, merged_lse, grad_out, 0.3, causal)
    for name, a, b in zip(("dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=lambda msg: f"{name}: {msg}")


def test_a_non_finite_key_poisons_only_the_rows_that_see_it():
    layout = LAYOUTS["packed_tail"]()
    q, k, v = qkv(layout.num_rows, 2, 2, 16, 16)
    k[5, 1, 3] = float("nan")  # segment [0, 14), group 1
    out, lse = triton_dense.dense_attention(q, k, v, layout, 0.3)
    out_ref, lse_ref = causal_attention(q, k, v, layout, 0.3)
    out, out_ref = out[:33], out_ref[:33]  # the real rows
    assert torch.equal(torch.isnan(out), torch.isnan(out_ref)) and torch.isnan(out[5:14, 1]).all()
    finite = ~torch.isnan(out_ref)
    torch.testing.assert_close(out[finite], out_ref[finite], **TOL)


def test_no_rows():
    q, k, v = qkv(0, 2, 2, 16, 16)
    out, lse = triton_dense.dense_attention(q, k, v, TokenLayout.packed(torch.tensor([0]), 0, CPU), 0.3)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


def test_m_layer_through_the_kernels_matches_the_reference_layer():
    """A tiny `M` layer (GQA, qk 40 + 8 / v 32) on packed input, the dense attention requested as `triton`,
    against the same layer through the reference: output, input and every parameter gradient."""
    config = HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern="M", num_query_groups=2,
                                               qk_head_dim=40)
    torch.manual_seed(0)
    reference = HybridAttention(config.replace(attention_backend="unfused"), kind="M")
    fused = HybridAttention(config.replace(attention_backend_overrides={"dense_attention": "triton"}), kind="M")
    fused.load_state_dict(reference.state_dict())
    packed = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 11, 30], dtype=torch.int32), max_seqlen_q=19)
    hidden = torch.randn(30, 1, config.hidden_size)
    results = []
    for layer in (fused, reference):
        x = hidden.clone().requires_grad_()
        reset_call_counts()
        out, _ = layer(x, packed_seq_params=packed)
        out.square().sum().backward()
        results.append((out, x.grad, {n: p.grad for n, p in layer.named_parameters()}, call_counts()))
    (out, grad_x, grads, counts), (out_ref, grad_x_ref, grads_ref, _) = results
    assert counts[("triton", "dense_attention")] == 1, counts
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(grad_x, grad_x_ref, **TOL)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], **TOL, msg=lambda m: f"{name}: {m}")
