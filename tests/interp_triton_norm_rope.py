"""Triton RMSNorm + partial RoPE in the CPU interpreter vs the unfused composition
(`megatron_dsa.ops.rope.norm_rope` = `rope(rms_norm(x, weight, eps), positions, inv_freq)`), weightless
(the query path) and weighted (the compressor's entries, whose weight takes a gradient).

Run by `test_triton_norm_rope.py::test_interpreted_kernels` in a child process with
`TRITON_INTERPRET=1` (see `triton_support.py`). The kernel repeats the reference's rounding steps;
what differs is the summation order of mean(x²) and mean(∂n·x) and cos/sin of the interpreter
(numpy) vs torch, a few ulps of the compute dtype on values of order 1: float32 rtol/atol 1e-5,
float64 rtol/atol 1e-12.
"""

import pytest
import torch

from megatron_dsa.backends import OpFamily, resolve
from megatron_dsa.backends.triton_kernels import norm_rope as triton_norm_rope
from megatron_dsa.backends.triton_kernels.rope import row_block
from megatron_dsa.ops.rope import norm_rope as reference_norm_rope, plain_inv_freq
from saved_tensors import SavedTensorGuard
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}
EPS = 1e-6
# (6, 2, 21) with 12 rotary dims: an odd pass-through width and pairs that do not fill their block.
SHAPES = [((9, 8), 8), ((9, 40), 16), ((7, 3, 40), 8), ((5, 2, 64), 16), ((6, 64), 8), ((4, 3, 8), 8),
          ((6, 2, 21), 12)]


def _case(shape, rotary_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Rows of different scales, so that rstd is not ≈ 1 everywhere.
    scale = torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64) * 4 + 0.1
    x = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    positions = torch.randint(0, 70000, (shape[0],), generator=gen)  # angles far beyond 2π
    return x, positions, plain_inv_freq(rotary_dim, base=10000.0)


def _weight(width, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(width, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()


def _forward_and_grad(fn, x, positions, inv_freq, upstream, weight=None):
    """`(out, dx)`, and the weight gradient after them when a weight is given."""
    out = fn(x, positions, inv_freq, EPS, weight)
    grads = torch.autograd.grad(out, (x,) if weight is None else (x, weight), upstream)
    return (out, *grads)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,rotary_dim", SHAPES)
def test_forward_and_grad_match_reference(dtype, shape, rotary_dim, weighted):
    x, positions, inv_freq = _case(shape, rotary_dim, dtype)
    weight = _weight(shape[-1], dtype) if weighted else None
    before = x.detach().clone()
    upstream = torch.randn(shape, dtype=dtype)
    got = _forward_and_grad(triton_norm_rope.norm_rope, x, positions, inv_freq, upstream, weight)
    expected = _forward_and_grad(reference_norm_rope, x, positions, inv_freq, upstream, weight)
    assert got[0].shape == x.shape and got[0].dtype == dtype
    assert got[0].data_ptr() != x.data_ptr()
    for a, b in zip(got, expected):  # out, dx (, dw)
        torch.testing.assert_close(a, b, **TOL[dtype])
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("weighted", [False, True])
def test_heads_of_one_token_share_their_angles(weighted):
    """Row blocks that hold heads of one token compute its angles once (`ONE_TOKEN`); 16 heads over
    blocks of 8 rows take that path, and each token still turns by its own position."""
    x, positions, inv_freq = _case((5, 16, 40), 16, torch.float64)
    assert 16 % row_block(40)[1] == 0  # the case runs the shared-angle path
    weight = _weight(40, torch.float64) if weighted else None
    upstream = torch.randn(x.shape, dtype=torch.float64)
    got = _forward_and_grad(triton_norm_rope.norm_rope, x, positions, inv_freq, upstream, weight)
    expected = _forward_and_grad(reference_norm_rope, x, positions, inv_freq, upstream, weight)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def test_weight_gradient_sums_over_more_row_blocks_than_programs(monkeypatch):
    """Past `DWEIGHT_PROGRAMS` row blocks each backward program loops over several blocks and the partial
    weight gradients are summed: 2 programs over 9 blocks of 8 rows give the reference's dx and dw."""
    monkeypatch.setattr(triton_norm_rope, "DWEIGHT_PROGRAMS", 2)
    x, positions, inv_freq = _case((70, 40), 16, torch.float64)
    weight = _weight(40, torch.float64)
    upstream = torch.randn(70, 40, dtype=torch.float64)
    got = _forward_and_grad(triton_norm_rope.norm_rope, x, positions, inv_freq, upstream, weight)
    expected = _forward_and_grad(reference_norm_rope, x, positions, inv_freq, upstream, weight)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def test_frozen_weight_gets_no_gradient_and_weight_rules_raise():
    x, positions, inv_freq = _case((5, 40), 16, torch.float32)
    frozen = _weight(40, torch.float32).detach()
    out = triton_norm_rope.norm_rope(x, positions, inv_freq, EPS, frozen)
    torch.testing.assert_close(out, reference_norm_rope(x, positions, inv_freq, EPS, frozen), **TOL[torch.float32])
    out.sum().backward()
    assert frozen.grad is None and x.grad is not None
    with pytest.raises(ValueError, match="norm_rope weight must be \\[D\\] with D = 40"):
        triton_norm_rope.norm_rope(x, positions, inv_freq, EPS, frozen[:8])
    with pytest.raises(TypeError, match="triton norm_rope needs weight of dtype among"):
        triton_norm_rope.norm_rope(x, positions, inv_freq, EPS, frozen.to(torch.int32))


def test_bfloat16_path_runs_close_to_the_reference():
    """A smoke test of the 16-bit path only: triton 3.6's interpreter casts float32 to bfloat16 by
    truncation, not to nearest, so each of the roundings the kernel repeats (n, cos/sin, products,
    sums) may lose up to one ulp more than the reference's; bound: 4 ulps (2^-7 relative) of the
    largest value, in the output and in the input grad. Rounding fidelity is the GPU test's job."""
    x, positions, inv_freq = _case((8, 4, 64), 16, torch.bfloat16)
    weight = _weight(64, torch.bfloat16)
    upstream = torch.randn(x.shape, dtype=torch.bfloat16)
    got = _forward_and_grad(triton_norm_rope.norm_rope, x, positions, inv_freq, upstream, weight)
    expected = _forward_and_grad(reference_norm_rope, x, positions, inv_freq, upstream, weight)
    for what, a, b in zip(("out", "grad", "weight grad"), got, expected):
        bound = 4 * 2.0 ** -7 * b.abs().max().float()
        assert (a - b).abs().float().max() <= bound, f"{what}: more than 4 ulps of the largest value"


def test_strided_input_and_empty_rows():
    x, positions, inv_freq = _case((6, 3, 40), 16, torch.float32)
    strided, positions = x.detach().transpose(0, 1), positions[:3]  # [3 tokens, 6 heads, 40]
    assert not strided.is_contiguous()
    torch.testing.assert_close(triton_norm_rope.norm_rope(strided, positions, inv_freq, EPS),
                               reference_norm_rope(strided, positions, inv_freq, EPS), **TOL[torch.float32])
    empty = torch.zeros(0, 3, 40, requires_grad=True)
    out = triton_norm_rope.norm_rope(empty, positions[:0], inv_freq, EPS)
    assert out.shape == empty.shape
    out.sum().backward()
    assert empty.grad.shape == empty.shape


@pytest.mark.parametrize("weighted", [False, True])
def test_rows_of_a_wider_tensor_are_read_in_place(monkeypatch, weighted):
    """A column slice `[T, Dh]` of wider rows (as the layer's stacked projections hand the K = V latent over)
    is read in place, never copied; value and grads equal the reference's on the same slice, float64."""
    wide, positions, inv_freq = _case((9, 100), 16, torch.float64)
    x = wide[:, 30:70]  # Dh = 40, row stride 100
    weight = _weight(40, torch.float64) if weighted else None
    upstream = torch.randn(9, 40, dtype=torch.float64)
    copied = []
    original = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous",
                        lambda self, *a, **k: copied.append(self.data_ptr() == x.data_ptr()) or original(self, *a, **k))
    got = _forward_and_grad(triton_norm_rope.norm_rope, x, positions, inv_freq, upstream, weight)
    monkeypatch.undo()
    assert not any(copied), "x was copied"
    expected = _forward_and_grad(reference_norm_rope, x, positions, inv_freq, upstream, weight)
    for what, a, b in zip(("out", "dx", "dweight"), got, expected):
        torch.testing.assert_close(a, b, **TOL[torch.float64], msg=what)


def test_tensor_saved_by_autograd_is_not_changed():
    """A tensor another op saved for backward (here y, saved by y·y) is the kernel's input: it must
    come out unchanged, and so must what the kernel saved itself (x, positions, frequencies, eps).
    A kernel writing through the raw pointer does not bump `_version`, hence the clone comparison."""
    x, positions, inv_freq = _case((8, 2, 40), 16, torch.float32)
    with SavedTensorGuard().watching() as guard:
        y = x * 1.5
        out = (y * y).sum() + triton_norm_rope.norm_rope(y, positions, inv_freq, EPS).sum()
    out.backward()
    assert guard.unpacked >= 5, "the kernel's saved tensors were not seen: the check did not run"


def test_dispatch_runs_the_kernel_when_requested_by_name():
    name, impl = resolve(OpFamily.NORM_ROPE, "triton", device=torch.device("cpu"), dtype=torch.float32)
    assert name == "triton" and impl is triton_norm_rope.norm_rope
    assert resolve(OpFamily.NORM_ROPE, device=torch.device("cpu"), dtype=torch.float32)[0] == "unfused"
    with pytest.raises(Exception, match="dtype torch.int32 unsupported"):
        resolve(OpFamily.NORM_ROPE, "triton", device=torch.device("cpu"), dtype=torch.int32)


def test_invalid_inputs_raise():
    x, positions, inv_freq = _case((5, 40), 16, torch.float32)
    with pytest.raises(ValueError, match="norm_rope expects x \\[T, Dh\\] or \\[T, H, Dh\\]"):
        triton_norm_rope.norm_rope(x[0], positions, inv_freq, EPS)
    with pytest.raises(ValueError, match="norm_rope positions must be \\[T\\]"):
        triton_norm_rope.norm_rope(x, positions[:4], inv_freq, EPS)
    with pytest.raises(ValueError, match="norm_rope inv_freq must be a non-empty"):
        triton_norm_rope.norm_rope(x, positions, inv_freq[:0], EPS)
    with pytest.raises(ValueError, match="exceed the head dim"):
        triton_norm_rope.norm_rope(x[:, :8], positions, inv_freq, EPS)
    with pytest.raises(TypeError, match="triton norm_rope needs x of dtype among"):
        triton_norm_rope.norm_rope(x.to(torch.int32), positions, inv_freq, EPS)
    with pytest.raises(TypeError, match="norm_rope positions must be int32, int64 or floating"):
        triton_norm_rope.norm_rope(x, positions.to(torch.int16), inv_freq, EPS)
    with pytest.raises(TypeError, match="norm_rope eps must be a float"):
        triton_norm_rope.norm_rope(x, positions, inv_freq, torch.tensor(EPS))
    with pytest.raises(ValueError, match="norm_rope eps must be finite and >= 0"):
        triton_norm_rope.norm_rope(x, positions, inv_freq, -1e-6)
