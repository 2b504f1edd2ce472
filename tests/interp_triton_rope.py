"""Triton partial RoPE in the CPU interpreter vs the unfused reference (`megatron_dsa.ops.rope.rope`).

Run by `test_triton_rope.py::test_interpreted_kernels` in a child process with `TRITON_INTERPRET=1`
(see `triton_support.py`). The kernel follows the reference's rounding step by step; the only
difference left is cos/sin of the interpreter (numpy) vs torch, ≤ 1 ulp of the angle dtype: float32
rtol 1e-6 / atol 1e-6, float64 rtol 1e-12 / atol 1e-12.
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels import rope as triton_rope
from megatron_dsa.ops.rope import plain_inv_freq, rope as reference_rope
from saved_tensors import SavedTensorGuard

from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _case(shape, rotary_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()
    positions = torch.randint(0, 70000, (shape[0],), generator=gen)  # angles far beyond 2π
    return x, positions, plain_inv_freq(rotary_dim, base=10000.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# (6, 2, 21) with 12 rotary dims: an odd pass-through width and pairs that do not fill their block.
@pytest.mark.parametrize("shape,rotary_dim", [((9, 8), 8), ((9, 40), 16), ((7, 3, 40), 8), ((11, 2, 8), 8),
                                              ((6, 2, 21), 12)])
@pytest.mark.parametrize("inverse,amplitude", [(False, 1.0), (True, 1.0), (False, 0.7), (True, 1.3)])
def test_forward_and_grad_match_reference(dtype, shape, rotary_dim, inverse, amplitude):
    x, positions, inv_freq = _case(shape, rotary_dim, dtype)
    before = x.detach().clone()
    got = triton_rope.rope(x, positions, inv_freq, inverse=inverse, amplitude=amplitude)
    expected = reference_rope(x, positions, inv_freq, inverse=inverse, amplitude=amplitude)
    assert got.shape == x.shape and got.dtype == dtype
    assert got.data_ptr() != x.data_ptr()  # fresh storage, also when every dim rotates
    torch.testing.assert_close(got, expected, **TOL[dtype])
    upstream = torch.randn_like(got)
    grad_got, = torch.autograd.grad(got, x, upstream)
    grad_expected, = torch.autograd.grad(expected, x, upstream)
    torch.testing.assert_close(grad_got, grad_expected, **TOL[dtype])
    assert torch.equal(x.detach(), before)
    nope = shape[-1] - rotary_dim
    assert torch.equal(got[..., :nope], before[..., :nope])  # pass-through dims copied exactly


def test_heads_of_one_token_share_their_angles():
    """Row blocks that hold heads of one token compute its angles once (`ONE_TOKEN`); 16 heads over
    blocks of 8 rows take that path, and each token still turns by its own position."""
    x, positions, inv_freq = _case((5, 16, 40), 16, torch.float64)
    assert 16 % triton_rope.row_block(40)[1] == 0  # the case runs the shared-angle path
    got = triton_rope.rope(x, positions, inv_freq, inverse=True, amplitude=0.8)
    expected = reference_rope(x, positions, inv_freq, inverse=True, amplitude=0.8)
    torch.testing.assert_close(got, expected, **TOL[torch.float64])
    upstream = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, x, upstream)[0],
                               torch.autograd.grad(expected, x, upstream)[0], **TOL[torch.float64])


def test_inverse_undoes_forward():
    x, positions, inv_freq = _case((6, 4, 40), 16, torch.float64)
    there = triton_rope.rope(x, positions, inv_freq)
    torch.testing.assert_close(triton_rope.rope(there, positions, inv_freq, inverse=True), x, **TOL[torch.float64])


def test_tensor_saved_by_autograd_is_not_changed():
    """A1.1 (Megatron #5526): rotating a tensor another op saved for backward must not rewrite it.
    A kernel writing through the raw pointer does not bump `_version`, hence the clone comparison."""
    x, positions, inv_freq = _case((8, 2, 40), 16, torch.float32)
    with SavedTensorGuard().watching() as guard:
        y = x * 1.5
        out = (y * y).sum() + triton_rope.rope(y, positions, inv_freq, inverse=True).sum()
    out.backward()
    assert guard.unpacked > 0, "no tensor was saved: the check did not run"


def test_invalid_inputs_raise():
    x, positions, inv_freq = _case((5, 40), 16, torch.float32)
    with pytest.raises(ValueError, match="x \\[T, Dh\\] or \\[T, H, Dh\\]"):
        triton_rope.rope(x[0], positions, inv_freq)
    with pytest.raises(ValueError, match="positions must be \\[T\\]"):
        triton_rope.rope(x, positions[:4], inv_freq)
    with pytest.raises(ValueError, match="exceed the head dim"):
        triton_rope.rope(x[:, :8], positions, inv_freq)
    with pytest.raises(TypeError, match="dtype among"):
        triton_rope.rope(x.to(torch.int32), positions, inv_freq)
