"""Triton sparse attention in the CPU interpreter against the unfused reference (docs/math.md §7):
outputs, LSE and the gradients of query, kv and sink, with and without a gradient through the LSE.

Not collected by the default suite: `test_triton_sparse_attention.py` runs this file in a child
process under the interpreter (`triton_support.run_interpreted`, which says why).

Tolerance (fp32 kernel vs fp32 reference): the two differ only in summation order, atol 2e-5 / rtol 1e-4.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from torch import Tensor

import megatron_dsa.backends.triton_kernels.sparse_attention as triton_sparse
from megatron_dsa.backends import reset_call_counts, variant_counts
from megatron_dsa.backends.triton_kernels.sparse_attention import (
    sparse_attention_backward,
    sparse_attention_forward,
)
from megatron_dsa.ops.sparse_attention import sparse_attention
from triton_support import interpreter  # noqa: F401  (fixture)

CPU_TOL = dict(atol=2e-5, rtol=1e-4)
NAMES = ("out", "lse", "grad_query", "grad_kv", "grad_sink")


pytestmark = pytest.mark.usefixtures("interpreter")


# ---------------------------------------------------------------- helpers
def make_inputs(rows: int, heads: int, dim: int, width: int, kv_rows: int, *, padding: float = 0.2,
                dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """Random query, kv, sink and index rows with -1 padding (fraction `padding`) and duplicates."""
    gen = torch.Generator(device=device).manual_seed(seed)
    query = torch.randn(rows, heads, dim, generator=gen, device=device).to(dtype)
    kv = torch.randn(kv_rows, dim, generator=gen, device=device).to(dtype)
    sink = torch.randn(heads, generator=gen, device=device)
    indices = torch.randint(0, kv_rows, (rows, width), generator=gen, device=device)
    pad = torch.rand(rows, width, generator=gen, device=device) < padding
    return query, kv, indices.masked_fill(pad, -1), sink


def reference(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float, grad_out: Tensor,
              grad_lse: Optional[Tensor]) -> tuple[Tensor, ...]:
    """`(out, lse, grad_query, grad_kv, grad_sink)` by autograd through the unfused op."""
    leaves = [t.detach().clone().requires_grad_() for t in (query, kv, sink)]
    out, lse = sparse_attention(leaves[0], leaves[1], indices, leaves[2], scale)
    outputs, upstream = (out,), (grad_out,)
    if grad_lse is not None:
        outputs, upstream = (out, lse), (grad_out, grad_lse)
    grads = torch.autograd.grad(outputs, leaves, upstream)
    return (out.detach(), lse.detach(), *grads)


def run_triton(query: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float, grad_out: Tensor,
               grad_lse: Optional[Tensor]) -> tuple[Tensor, ...]:
    out, lse = sparse_attention_forward(query, kv, indices, sink, scale)
    return (out, lse, *sparse_attention_backward(query, kv, indices, sink, scale, out, lse, grad_out, grad_lse))



def assert_matches_reference(query, kv, indices, sink, scale, grad_lse_given: bool) -> tuple[Tensor, ...]:
    grad_out = torch.randn_like(query)
    grad_lse = torch.randn(query.shape[:2]) if grad_lse_given else None
    got = run_triton(query, kv, indices, sink, scale, grad_out, grad_lse)
    expected = reference(query, kv, indices, sink, scale, grad_out, grad_lse)
    for name, a, b in zip(NAMES, got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, **CPU_TOL, msg=lambda m, n=name: f"{n}: {m}")
    return got


# ---------------------------------------------------------------- CPU, interpreter
@pytest.mark.parametrize("rows, heads, dim, width, kv_rows", [
    (8, 1, 16, 5, 7),      # one head (padded to 16 in the dot), a single partial index block
    (12, 4, 32, 16, 40),   # tiny preset head shape, exactly one index block
    (24, 16, 48, 37, 30),  # head dim 48 = 32 + tail chunk 16; three index blocks, the last partial
    (10, 20, 20, 37, 9),   # 20 heads (block of 32, 12 masked); D = 16 + masked tail; many duplicates
    (6, 16, 64, 20, 25),   # full tiles: the kv-gradient kernel's two column chunks load without masks
], ids=["h1_d16_k5", "h4_d32_k16", "h16_d48_k37", "h20_d20_k37", "h16_d64_k20"])
@pytest.mark.parametrize("grad_lse_given", [False, True], ids=["no_dlse", "dlse"])
def test_matches_reference(rows, heads, dim, width, kv_rows, grad_lse_given):
    query, kv, indices, sink = make_inputs(rows, heads, dim, width, kv_rows)
    indices[rows // 2] = -1  # one row without any valid index
    assert_matches_reference(query, kv, indices, sink, dim ** -0.5, grad_lse_given)


def test_the_portable_kernels_run_here_and_are_counted_as_such():
    """The interpreter cannot run the Gluon kernels: each pass runs the portable one, and the call counter
    of the `triton` backend's variants says so."""
    query, kv, indices, sink = make_inputs(6, 4, 16, 5, 9)
    reset_call_counts()
    run_triton(query, kv, indices, sink, 0.3, torch.randn_like(query), None)
    assert variant_counts() == {("triton", "sparse_attention_fwd", "portable"): 1,
                                ("triton", "sparse_attention_bwd", "portable"): 1}


def test_wide_kv_offsets_match_reference(monkeypatch):
    """The int64 offset path (taken when `M * D >= 2^31`, too large for a CPU test) forced on a small kv."""
    monkeypatch.setattr(triton_sparse._Prepared, "wide_offsets", property(lambda self: True))
    query, kv, indices, sink = make_inputs(10, 4, 32, 20, 25)
    assert_matches_reference(query, kv, indices, sink, 32 ** -0.5, True)


@pytest.mark.parametrize("grad_lse_given", [False, True], ids=["no_dlse", "dlse"])
def test_empty_and_out_of_range_rows(grad_lse_given):
    """Rows whose indices are all -1 or outside [0, M) give out 0, lse -inf, zero query gradient,
    no kv gradient from them, finite everything; out-of-range ids elsewhere are ignored."""
    query, kv, indices, sink = make_inputs(9, 4, 32, 16, 12)
    indices[0] = -1
    indices[3] = torch.tensor([-5, 12, 13, 1000] * 4)
    indices[5, ::3] = 12  # out of range (M = 12) among valid ids
    out, lse, grad_query, grad_kv, grad_sink = assert_matches_reference(
        query, kv, indices, sink, 0.3, grad_lse_given)
    for row in (0, 3):
        assert torch.equal(out[row], torch.zeros_like(out[row]))
        assert torch.equal(lse[row], torch.full_like(lse[row], -math.inf))
        assert torch.equal(grad_query[row], torch.zeros_like(grad_query[row]))
    for tensor in (out, grad_query, grad_kv, grad_sink):
        assert torch.isfinite(tensor).all()
    assert torch.isfinite(lse[[1, 2, 4, 5, 6, 7, 8]]).all()


def test_kv_rows_only_used_by_empty_rows_get_no_gradient():
    query, kv, indices, sink = make_inputs(6, 4, 16, 8, 10)
    indices[indices >= 8] = -1  # rows 8 and 9 of kv are never attended
    grads = run_triton(query, kv, indices, sink, 0.25, torch.randn_like(query), torch.randn(6, 4))
    assert torch.equal(grads[3][8:], torch.zeros(2, 16))
    assert grads[3][:8].abs().sum() > 0


def test_duplicate_indices_count_as_separate_keys():
    """A key listed twice carries twice the weight, as in the reference: the same as adding ln 2 to
    its logit (checked on a row with one duplicated key against a row without)."""
    query, kv, _, sink = make_inputs(2, 4, 16, 3, 5)
    query[1] = query[0]
    indices = torch.tensor([[0, 2, 2], [0, 2, -1]])
    assert_matches_reference(query, kv, indices, sink, 0.5, True)
    _, lse = sparse_attention_forward(query, kv, indices, sink, 0.5)
    scores = 0.5 * query[0] @ kv[[0, 2]].T  # [H, 2]
    expected_lse = torch.logsumexp(torch.stack([scores[:, 0], scores[:, 1] + math.log(2)], -1), -1)
    torch.testing.assert_close(lse[0], expected_lse, **CPU_TOL)
    torch.testing.assert_close(lse[1], torch.logsumexp(scores, -1), **CPU_TOL)


@pytest.mark.parametrize("sink_value", [30.0, -30.0])
def test_extreme_sinks(sink_value):
    query, kv, indices, _ = make_inputs(8, 4, 32, 16, 20)
    sink = torch.tensor([sink_value, -sink_value, 0.0, sink_value / 2])
    got = assert_matches_reference(query, kv, indices, sink, 32 ** -0.5, True)
    for tensor in got:
        assert not torch.isnan(tensor).any()


def test_int32_and_int64_indices_agree_and_huge_ids_never_wrap():
    query, kv, indices, sink = make_inputs(8, 4, 16, 16, 20)
    indices[:, 0] = 2 ** 32 + 3  # would wrap to the valid id 3 under a plain int32 cast
    grad_out = torch.randn_like(query)
    wide = run_triton(query, kv, indices, sink, 0.3, grad_out, None)
    expected = reference(query, kv, indices, sink, 0.3, grad_out, None)
    for name, a, b in zip(NAMES, wide, expected):
        torch.testing.assert_close(a, b, **CPU_TOL, msg=lambda m, n=name: f"{n}: {m}")
    indices[:, 0] = -1
    narrow = run_triton(query, kv, indices.to(torch.int32), sink, 0.3, grad_out, None)
    for name, a, b in zip(NAMES, wide, narrow):
        assert torch.equal(a, b), name


def test_no_index_columns():
    query, kv, _, sink = make_inputs(4, 4, 16, 1, 6)
    indices = torch.empty(4, 0, dtype=torch.int64)
    out, lse, grad_query, grad_kv, grad_sink = run_triton(
        query, kv, indices, sink, 0.3, torch.randn_like(query), torch.randn(4, 4))
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.full_like(lse, -math.inf))
    for grad in (grad_query, grad_kv, grad_sink):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_inputs_are_not_mutated():
    query, kv, indices, sink = make_inputs(8, 4, 32, 16, 20)
    out, lse = sparse_attention_forward(query, kv, indices, sink, 0.2)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    tensors = (query, kv, indices, sink, out, lse, grad_out, grad_lse)
    before = [t.clone() for t in tensors]
    sparse_attention_backward(query, kv, indices, sink, 0.2, out, lse, grad_out, grad_lse)
    sparse_attention_forward(query, kv, indices, sink, 0.2)
    for a, b in zip(tensors, before):
        assert torch.equal(a, b)


def test_non_contiguous_inputs():
    query, kv, indices, sink = make_inputs(8, 4, 32, 16, 20)
    strided_query = torch.randn(8, 32, 4).transpose(1, 2)  # [8, 4, 32], last dim strided
    assert not strided_query.is_contiguous()
    grad_out = torch.randn_like(query)
    got = run_triton(strided_query, kv.T.contiguous().T, indices.T.contiguous().T, sink, 0.2, grad_out, None)
    expected = reference(strided_query.contiguous(), kv, indices, sink, 0.2, grad_out, None)
    for name, a, b in zip(NAMES, got, expected):
        torch.testing.assert_close(a, b, **CPU_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_float64_is_rejected():
    query, kv, indices, sink = make_inputs(4, 4, 16, 8, 10, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        sparse_attention_forward(query, kv, indices, sink, 0.3)


def test_backward_input_validation():
    query, kv, indices, sink = make_inputs(4, 4, 16, 8, 10)
    out, lse = sparse_attention_forward(query, kv, indices, sink, 0.3)
    good = dict(query=query, kv=kv, indices=indices, sink=sink, scale=0.3, out=out, lse=lse,
                grad_out=torch.randn_like(out), grad_lse=None)
    for name, value, error in (("out", out[:2], ValueError), ("out", out.to(torch.bfloat16), TypeError),
                               ("lse", lse[:, :2], ValueError), ("grad_out", out[..., :8], ValueError),
                               ("grad_lse", lse.unsqueeze(-1), ValueError),
                               ("grad_lse", lse.long(), TypeError)):
        with pytest.raises(error, match=name):
            sparse_attention_backward(**{**good, name: value})


def test_kernels_are_decorated_per_mode(monkeypatch):
    """The kernels are decorated on first use and cached per mode, following the switch `triton.jit`
    reads: interpreted here; with the switch off, compiled and autotuned (built, not run: triton's own
    library functions in this process were decorated for the interpreter)."""
    interpreted = triton_sparse._kernels()
    assert not interpreted.autotuned and type(interpreted.forward).__name__ == "InterpretedFunction"
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled = triton_sparse._kernels()
    assert compiled.autotuned and type(compiled.forward.fn).__name__ == "JITFunction"
    assert type(compiled.backward.fn).__name__ == "JITFunction"


@pytest.mark.parametrize("grad_lse_given", [False, True], ids=["no_dlse", "dlse"])
def test_float16_matches_fp32_reference(grad_lse_given):
    """The 16-bit path (probabilities and dS rounded to the input dtype before their dots, output and
    gradients rounded once). bf16 is checked on the GPU only: the interpreter's `tl.dot` misreads bf16.
    Reference: fp32 from the same fp16 inputs. Tolerance: fp16 keeps 11 significant bits, so each
    rounding is <= 2^-11 relative; a few of them add up on outputs and gradients of size ~1: 4e-3."""
    query, kv, indices, sink = make_inputs(12, 16, 48, 37, 30, dtype=torch.float16)
    grad_out = torch.randn(query.shape).to(torch.float16)
    grad_lse = torch.randn(query.shape[:2]) if grad_lse_given else None
    got = run_triton(query, kv, indices, sink, 48 ** -0.5, grad_out, grad_lse)
    expected = reference(query.float(), kv.float(), indices, sink, 48 ** -0.5, grad_out.float(), grad_lse)
    for name, a, b in zip(NAMES, got, expected):
        assert a.dtype == (torch.float16 if name in ("out", "grad_query", "grad_kv") else torch.float32), name
        torch.testing.assert_close(a.float(), b, atol=4e-3, rtol=4e-3, msg=lambda m, n=name: f"{n}: {m}")
