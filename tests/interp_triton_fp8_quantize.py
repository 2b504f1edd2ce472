"""Triton FP8 row quantization in the CPU interpreter vs `ops.fp8_linear.quantize_rows` on the zero-padded
operand (what `torch_scaled_mm` quantized before it had the kernel), and its one-launch form for the few-rows FP8
GEMM (`quantize_each_row`).

Run by `test_triton_fp8_quantize.py::test_interpreted_kernel` in a child process with `TRITON_INTERPRET=1`
(see `triton_support.py`). Both sides divide in float32 with correct rounding and round to nearest e4m3, so
the comparisons are bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_dsa.backends.triton_kernels.fp8_quantize import EACH_ROW_BLOCK_K, quantize_each_row, quantize_rows
from megatron_dsa.ops.fp8_linear import quantize_rows as reference_quantize_rows

from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")


def expected(t: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = reference_quantize_rows(F.pad(t, (0, width - t.shape[1], 0, rows - t.shape[0])))
    return q, scale.float()


def assert_same(got, want) -> None:
    (q, scale), (q_want, scale_want) = got, want
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and q.shape == q_want.shape
    assert scale.dtype == torch.float32 and scale.shape == scale_want.shape
    assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))
    assert torch.equal(scale, scale_want) or torch.allclose(scale, scale_want, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,padded", [((37, 300), (37, 304)), ((16, 512), (16, 512)), ((5, 3), (16, 16))])
def test_rows_match_the_reference_bit_for_bit(dtype, shape, padded):
    """Several column steps per row (300 > the block), row blocks with a tail, padding on both sides; values
    spread over many binades, with zero rows, so that rounding and the amax's exponent both vary."""
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[1])).to(dtype)
    t[min(2, shape[0] - 1)] = 0
    assert_same(quantize_rows(t, *padded), expected(t, *padded))


def test_a_transposed_view_is_read_in_place_and_matches():
    """The backward's operands are transposed views (`dyᵀ`, `xᵀ`, `Wᵀ`): the same numbers as a copy."""
    t = torch.randn(300, 40, dtype=torch.bfloat16).t()
    assert not t.is_contiguous()
    assert_same(quantize_rows(t, 48, 304), expected(t.contiguous(), 48, 304))


def test_non_finite_values_reach_the_scale_as_the_reference_does():
    """A NaN or an inf in a row makes its scale NaN or inf, so the GEMM's row comes out non-finite whatever
    the row's e4m3 values hold (the interpreter also converts NaN to e4m3 wrongly: those are not compared);
    finite rows are untouched."""
    t = torch.randn(4, 40)
    t[0, 3], t[1, 7], t[2, 0] = float("nan"), float("inf"), -float("inf")
    (q, scale), (q_want, scale_want) = quantize_rows(t, 4, 48), expected(t, 4, 48)
    assert scale[0].isnan().all() and scale[1].isinf().all() and scale[2].isinf().all()
    assert torch.equal(scale.isnan(), scale_want.isnan()) and torch.equal(scale.isinf(), scale_want.isinf())
    assert torch.equal(scale[3], scale_want[3]) and torch.equal(q[3].view(torch.uint8), q_want[3].view(torch.uint8))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="padded shape"):
        quantize_rows(torch.randn(4, 40), 4, 32)
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(torch.randn(4, 40, dtype=torch.float64), 4, 48)
    with pytest.raises(ValueError, match="quantize_each_row: t must be a 2-D"):
        quantize_each_row(torch.randn(4, 40, dtype=torch.float64))


def test_each_row_in_one_launch_matches_the_reference_bit_for_bit():
    a = (torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, 300)).bfloat16()
    a[2] = 0.0  # a zero row keeps zeros
    codes, scales = quantize_each_row(a.t().contiguous().t())  # strided rows read in place
    want_codes, want_scales = reference_quantize_rows(a)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales.float().view(-1))


def test_rows_longer_than_a_block_round_in_two_passes():
    a = (torch.randn(2, EACH_ROW_BLOCK_K + 100, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    codes, scales = quantize_each_row(a)
    want_codes, want_scales = reference_quantize_rows(a)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales.float().view(-1))
