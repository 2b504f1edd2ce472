"""Triton RMSNorm in the CPU interpreter vs the reference `megatron_dsa.ops.norms.rms_norm`.

Run by `test_triton_rms_norm.py::test_interpreted_kernels` in a child process with
`TRITON_INTERPRET=1` (see `triton_support.py`). The kernel rounds where the reference does; what
differs is the summation order of mean(x²), mean(gn·x) and of the weight gradient over rows, a few
ulps of the compute dtype on values of order 1: float32 rtol/atol 1e-5, float64 rtol/atol 1e-12.
"""

import pytest
import torch

from megatron_dsa.backends import OpFamily, resolve
from megatron_dsa.backends.triton_kernels import rms_norm as triton_rms_norm
from megatron_dsa.ops.norms import rms_norm as reference_rms_norm
from saved_tensors import SavedTensorGuard
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}
EPS = 1e-6
# Rows not a multiple of the row block (8 rows of D = 512, 32 of D = 48), D not a power of two.
SHAPES = [(37, 48), (3, 7, 48), (11, 512), (2, 5, 512), (9, 100)]


def _case(shape, dtype, weighted, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Rows of different scales, so that rstd is not ≈ 1 everywhere.
    scale = torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64) * 4 + 0.1
    x = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    weight = None
    if weighted:
        weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    upstream = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return x, weight, upstream


def _forward_and_grads(fn, x, weight, upstream):
    out = fn(x, weight, EPS)
    inputs = (x,) if weight is None else (x, weight)
    return (out, *torch.autograd.grad(out, inputs, upstream))


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_grads_match_reference(shape, dtype, weighted):
    x, weight, upstream = _case(shape, dtype, weighted)
    got = _forward_and_grads(triton_rms_norm.rms_norm, x, weight, upstream)
    expected = _forward_and_grads(reference_rms_norm, x, weight, upstream)
    assert got[0].shape == x.shape and got[0].dtype == dtype and got[0].data_ptr() != x.data_ptr()
    for what, a, b in zip(("out", "dx", "dweight"), got, expected):
        assert a.dtype == b.dtype, what
        torch.testing.assert_close(a, b, **TOL[dtype], msg=what)


def test_weight_gradient_summed_over_programs_that_loop(monkeypatch):
    """With fewer backward programs than row blocks, each program sums several blocks into its
    partial row: 2 programs over 23 blocks of 8 rows (and a ragged last block)."""
    monkeypatch.setattr(triton_rms_norm, "DWEIGHT_PROGRAMS", 2)
    x, weight, upstream = _case((181, 512), torch.float64, weighted=True, seed=1)
    got = _forward_and_grads(triton_rms_norm.rms_norm, x, weight, upstream)
    expected = _forward_and_grads(reference_rms_norm, x, weight, upstream)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


@pytest.mark.parametrize("weighted", [True, False])
def test_gradcheck_float64(weighted):
    x, weight, _ = _case((3, 2, 12), torch.float64, weighted, seed=2)
    inputs = (x,) if weight is None else (x, weight)
    assert torch.autograd.gradcheck(
        lambda *t: triton_rms_norm.rms_norm(t[0], t[1] if weighted else None, EPS), inputs)


def test_mixed_dtypes_follow_the_reference():
    """float32 x with a float64 weight (the weight is cast to x's statistics dtype) and the other
    way round: outputs in x's dtype, the weight gradient in the weight's."""
    for x_dtype, w_dtype in ((torch.float32, torch.float64), (torch.float64, torch.float32)):
        x, _, upstream = _case((13, 48), x_dtype, weighted=False, seed=3)
        weight = torch.linspace(0.5, 1.5, 48, dtype=w_dtype).requires_grad_()
        got = _forward_and_grads(triton_rms_norm.rms_norm, x, weight, upstream)
        expected = _forward_and_grads(reference_rms_norm, x, weight, upstream)
        for a, b in zip(got, expected):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_bfloat16_path_runs_close_to_the_reference():
    """A smoke test of the 16-bit path only: triton 3.6's interpreter casts float32 to bfloat16 by
    truncation, not to nearest, so the single rounding of y and dx may lose one ulp more than the
    reference's; bound: 2 ulps (2^-7 relative) of the largest value. dweight is summed in float32
    over rows in another order and rounded once: same bound. Rounding fidelity is the GPU test's job."""
    x, weight, upstream = _case((40, 3, 64), torch.bfloat16, weighted=True)
    got = _forward_and_grads(triton_rms_norm.rms_norm, x, weight, upstream)
    expected = _forward_and_grads(reference_rms_norm, x, weight, upstream)
    for what, a, b in zip(("out", "dx", "dweight"), got, expected):
        assert a.dtype == torch.bfloat16, what
        bound = 2 * 2.0 ** -7 * b.abs().max().float()
        assert (a - b).abs().float().max() <= bound, f"{what}: more than 2 ulps of the largest value"


def test_strided_input_and_empty_rows():
    x, weight, _ = _case((6, 3, 40), torch.float32, weighted=True)
    strided = x.detach().transpose(0, 1)
    assert not strided.is_contiguous()
    torch.testing.assert_close(triton_rms_norm.rms_norm(strided, weight, EPS),
                               reference_rms_norm(strided, weight, EPS), **TOL[torch.float32])
    empty = torch.zeros(0, 3, 40, requires_grad=True)
    out = triton_rms_norm.rms_norm(empty, weight, EPS)
    assert out.shape == empty.shape
    out.sum().backward()
    assert empty.grad.shape == empty.shape and weight.grad is not None and not weight.grad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_of_a_wider_tensor_are_read_in_place(monkeypatch, dtype):
    """A column slice `[R, D]` of wider rows (as the layer's stacked projections hand q's latent over) is read
    in place, never copied; value and grads (x, weight) equal the reference's on the same slice."""
    wide, _, _ = _case((37, 130), dtype, weighted=False)
    _, weight, upstream = _case((37, 48), dtype, weighted=True, seed=1)
    x = wide[:, 70:118]  # D = 48, row stride 130
    copied = []
    original = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous",
                        lambda self, *a, **k: copied.append(self.data_ptr() == x.data_ptr()) or original(self, *a, **k))
    got = _forward_and_grads(triton_rms_norm.rms_norm, x, weight, upstream)
    monkeypatch.undo()
    assert not any(copied), "x was copied"
    expected = _forward_and_grads(reference_rms_norm, x, weight, upstream)
    for what, a, b in zip(("out", "dx", "dweight"), got, expected):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=what)


def test_inputs_and_saved_tensors_are_not_changed():
    """A tensor another op saved for backward (here y, saved by y·y) is the kernel's input: it must
    come out unchanged, and so must what the kernel saved itself (x, weight, eps). A kernel writing
    through the raw pointer does not bump `_version`, hence the clone comparison."""
    x, weight, upstream = _case((19, 48), torch.float32, weighted=True)
    weight_before = weight.detach().clone()
    with SavedTensorGuard().watching() as guard:
        y = x * 1.5
        out = (y * y).sum() + (triton_rms_norm.rms_norm(y, weight, EPS) * upstream).sum()
    out.backward()
    assert guard.unpacked >= 5, "the kernel's saved tensors were not seen: the check did not run"
    assert torch.equal(weight.detach(), weight_before)


def test_dispatch_runs_the_kernel_when_requested_by_name():
    cpu = torch.device("cpu")
    name, impl = resolve(OpFamily.RMS_NORM, "triton", device=cpu, dtype=torch.float64)
    assert name == "triton" and impl is triton_rms_norm.rms_norm
    assert resolve(OpFamily.RMS_NORM, device=cpu, dtype=torch.float32)[0] == "unfused"
    with pytest.raises(Exception, match="dtype torch.int32 unsupported"):
        resolve(OpFamily.RMS_NORM, "triton", device=cpu, dtype=torch.int32)


def test_invalid_inputs_raise():
    x, weight, _ = _case((5, 40), torch.float32, weighted=True)
    x, weight = x.detach(), weight.detach()
    with pytest.raises(ValueError, match=r"rms_norm expects x \[\.\.\., D\] with D >= 1"):
        triton_rms_norm.rms_norm(x[0, 0], weight, EPS)
    with pytest.raises(ValueError, match=r"rms_norm expects x \[\.\.\., D\] with D >= 1"):
        triton_rms_norm.rms_norm(x[:, :0], None, EPS)
    with pytest.raises(TypeError, match="triton rms_norm needs x of dtype among"):
        triton_rms_norm.rms_norm(x.to(torch.int32), weight, EPS)
    with pytest.raises(ValueError, match=r"rms_norm weight must be \[D\] with D = 40, got \(39,\)"):
        triton_rms_norm.rms_norm(x, weight[:39], EPS)
    with pytest.raises(ValueError, match=r"rms_norm weight must be \[D\]"):
        triton_rms_norm.rms_norm(x, weight.view(1, 40), EPS)
    with pytest.raises(TypeError, match="triton rms_norm needs weight of dtype among"):
        triton_rms_norm.rms_norm(x, weight.to(torch.int64), EPS)
    with pytest.raises(TypeError, match="rms_norm eps must be a float"):
        triton_rms_norm.rms_norm(x, weight, torch.tensor(EPS))
    with pytest.raises(ValueError, match="rms_norm eps must be finite and >= 0"):
        triton_rms_norm.rms_norm(x, weight, -1e-6)
    with pytest.raises(ValueError, match="rms_norm eps must be finite and >= 0"):
        triton_rms_norm.rms_norm(x, weight, float("nan"))
