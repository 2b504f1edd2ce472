"""The non-finite guard's Triton passes in the CPU interpreter against the torch ops they replace, bit for bit
(signed zeros and NaN payloads included): the stand-in and flags (`ops.dense_attention.finite_stand_in`,
`non_finite_heads`) and the fill of flagged rows (`torch.where`).

Run by `test_triton_non_finite_guard.py::test_interpreted_kernel` in a child process with `TRITON_INTERPRET=1`
(see `triton_support.py`).
"""

import pytest
import torch

from megatron_dsa.backends.dense_layout import fill_dead_rows, stand_in_and_flags
from megatron_dsa.backends.registry import reset_call_counts, variant_counts
from megatron_dsa.backends.triton_kernels.non_finite_guard import fill_flagged, finite_stand_in_with_flags
from megatron_dsa.ops.dense_attention import finite_stand_in, non_finite_heads

from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
SHAPES = [(9, 3, 12), (4, 1, 7), (2, 5, 40)]  # widths that are and are not powers of two, tails in the last program


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random values with NaN, +inf, −inf and −0.0 in some head vectors (several in one), the rest finite."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    flat = t.view(-1, shape[-1])
    for vector, dim, value in ((0, 0, float("nan")), (3, shape[-1] - 1, float("inf")), (5, 1, float("-inf")),
                               (5, 2, float("nan")), (6, 0, -0.0)):
        flat[vector % flat.shape[0], dim] = value
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as integers of its width: `torch.equal` on them tells −0.0 from 0.0 and compares NaN."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_matches_the_torch_ops(t: torch.Tensor) -> None:
    stand_in, flags = finite_stand_in_with_flags(t)
    assert stand_in.is_contiguous() and stand_in.dtype == t.dtype and stand_in.shape == t.shape
    assert torch.equal(bits(stand_in), bits(finite_stand_in(t)))
    assert flags.dtype == torch.bool and torch.equal(flags, non_finite_heads(t))
    for fill in (float("nan"), 0.0):
        filled = fill_flagged(t, flags, fill)
        assert filled.is_contiguous() and filled.dtype == t.dtype
        assert torch.equal(bits(filled), bits(torch.where(flags.unsqueeze(-1), fill, t)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_passes_match_the_torch_ops(dtype, shape):
    assert_matches_the_torch_ops(poisoned(shape, dtype))


def test_fill_leaves_unflagged_rows_bit_for_bit():
    """Flags that are not the tensor's own (the guard fills the rows that see a bad key, not only its own rows):
    every other row comes back bit for bit, a flagged row is all fill."""
    t = poisoned((9, 3, 12), torch.bfloat16)
    flags = torch.zeros(9, 3, dtype=torch.bool)
    flags[1, 2] = flags[8, 0] = True
    filled = fill_flagged(t, flags, float("nan"))
    assert torch.equal(bits(filled[~flags]), bits(t[~flags])) and torch.isnan(filled[flags]).all()


def test_a_head_slice_of_wider_rows_is_read_in_place():
    """v is a slice of the up-projection's `[T, G, qk + Dv]` rows: head and row strides of the wide tensor."""
    wide = poisoned((8, 3, 20), torch.bfloat16)
    v = wide[..., 12:]
    assert not v.is_contiguous()
    assert_matches_the_torch_ops(v)
    assert_matches_the_torch_ops(wide.transpose(0, 1))  # rows closer than heads


def test_empty_tensors():
    for shape in ((0, 2, 4), (3, 2, 0)):
        stand_in, flags = finite_stand_in_with_flags(torch.zeros(shape))
        assert stand_in.shape == shape and flags.shape == shape[:2] and not flags.any()
        assert fill_flagged(torch.zeros(shape), flags, 0.0).shape == shape


def test_the_guard_takes_the_torch_ops_under_the_interpreter():
    """The interpreter stands in for a CUDA device only for calls that name Triton: the guard's helpers (of every
    fused dense backend) take the torch ops here, with the same values."""
    reset_call_counts()
    t = poisoned((4, 2, 8), torch.float32)
    stand_in, flags = stand_in_and_flags(t)
    assert torch.equal(flags, non_finite_heads(t))
    assert torch.equal(bits(fill_dead_rows(t, flags, 0.0)), bits(torch.where(flags.unsqueeze(-1), 0.0, t)))
    assert variant_counts() == {}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_the_guard_on_its_triton_passes_equals_the_reference(monkeypatch, tensor, value):
    """`isolate_non_finite` around a kernel that leaks NaN (a whole-tile softmax and `P @ V`), its passes forced
    onto the Triton kernels as on a GPU: output, LSE and the q, k, v gradients equal the reference attention's
    (float64, packed layout with GQA), NaN rows included; every live row finite."""
    from megatron_dsa.backends import dense_layout
    from megatron_dsa.ops.dense_attention import causal_attention
    from megatron_dsa.ops.layout import TokenLayout
    from test_non_finite_isolation import BAD_VALUES, _leaky_kernel, _qkv

    monkeypatch.setattr(dense_layout, "_guard_runs_triton", lambda t: True)
    layout = TokenLayout.packed(torch.tensor([0, 6, 11], dtype=torch.int32), 11, torch.device("cpu"))
    inputs = dict(zip("qkv", _qkv(11)))
    inputs[tensor][3, 1, 0] = BAD_VALUES[value]
    grad_out = torch.randn(11, 4, 8, dtype=torch.float64)
    results = {}
    for name, attend in (("guarded", dense_layout.isolate_non_finite(_leaky_kernel)), ("reference", causal_attention)):
        leaves = [inputs[key].clone().requires_grad_() for key in "qkv"]
        out, lse = attend(*leaves, layout, 0.3)
        torch.where(torch.isnan(out), 0.0, out * grad_out).sum().backward()
        results[name] = (out.detach(), lse, *(leaf.grad for leaf in leaves))
    for what, got, want in zip(("out", "lse", "dq", "dk", "dv"), results["guarded"], results["reference"]):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-12, atol=1e-12, msg=what)
    assert torch.isfinite(results["guarded"][0][6:]).all()  # the other sequence
