"""The few-rows Triton FP8 GEMM in the CPU interpreter against `ops.fp8_linear.fp8_gemm_reference`.

Run by `test_triton_fp8_gemm.py::test_interpreted_kernels` in a child process with `TRITON_INTERPRET=1` (see
`triton_support.py`). The row rounding (`fp8_quantize.quantize_each_row`, tested in
`interp_triton_fp8_quantize.py`) is the reference's bit for bit; the products of e4m3 values are exact in float32
and the kernel scales the sum once where the reference scales every operand first, so the GEMM agrees to float32
rounding of the sum (relative 1e-5 here, against the 2⁻⁴ of the rounding itself).
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels import fp8_gemm
from megatron_dsa.ops.fp8_linear import fp8_gemm_reference, quantize_rows

from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")


def operands(rows: int, outputs: int, width: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 2, width)  # several binades per row: the rounding and the amax both vary
    a = (torch.randn(rows, width, generator=gen) * spread).to(dtype)
    b = (torch.randn(outputs, width, generator=gen) * spread.flip(0)).to(dtype)
    return a, b


@pytest.mark.parametrize("rows, outputs, width", [(1, 64, 128), (5, 70, 96), (33, 130, 256), (80, 20, 64)],
                         ids=["one_row", "tails", "two_row_blocks_wide", "more_rows_than_a_block"])
@pytest.mark.parametrize("splits", [1, 2, None], ids=["one_split", "two_splits", "default_splits"])
@pytest.mark.parametrize("kept", [False, True], ids=["b_rounded_here", "b_codes_kept"])
def test_gemm_matches_the_reference(rows, outputs, width, splits, kept):
    a, b = operands(rows, outputs, width, torch.float32)
    b_scales = None
    if kept:
        b, b_scales = quantize_rows(b)
    want = fp8_gemm_reference(a, b, torch.float32, b_scales)
    for _ in range(2):  # a second call finds the split tiles' tickets back at zero
        got = fp8_gemm.fp8_gemm(a, b, torch.float32, b_scales, splits=splits)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_unaligned_width_and_bf16_output():
    """K not a multiple of the step (masked columns). The interpreter converts float32 to bf16 by truncation, so
    the bf16 output is within one bf16 step (2⁻⁷ relative) here; the GPU test checks round-to-nearest."""
    a, b = operands(3, 40, 100, torch.bfloat16)
    want = fp8_gemm_reference(a, b, torch.float32)
    torch.testing.assert_close(fp8_gemm.fp8_gemm(a, b, torch.float32, splits=2), want, rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())
    got = fp8_gemm.fp8_gemm(a, b, torch.bfloat16, splits=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-5 * want.abs().max().item())


def test_non_finite_rows_reach_the_product():
    a, b = operands(2, 64, 64, torch.float32)
    a[1, 5] = float("inf")
    got = fp8_gemm.fp8_gemm(a, b, torch.float32)
    assert torch.isfinite(got[0]).all() and not torch.isfinite(got[1]).any()


@pytest.mark.parametrize("splits", [1, 2], ids=["one_split", "two_splits"])
def test_grouped_kept_codes_in_one_launch_match_the_reference_group_by_group(splits):
    """A grouped projection's kept codes `[G, N, K]` against a `[M, G·K]`: each group's rows of a rounded on their
    own (a group's columns are a row of the contraction), the products side by side."""
    groups, rows, outputs, width = 3, 5, 70, 64
    a, _ = operands(rows, 1, groups * width, torch.float32)
    _, b = operands(1, groups * outputs, width, torch.float32, seed=1)
    codes, scales = quantize_rows(b)
    codes, scales = codes.view(groups, outputs, width), scales.view(groups, outputs, 1)
    want = torch.cat([fp8_gemm_reference(a[:, g * width:(g + 1) * width], codes[g], torch.float32, scales[g])
                      for g in range(groups)], dim=1)
    torch.testing.assert_close(fp8_gemm_reference(a, codes, torch.float32, scales), want, rtol=0, atol=0)
    got = fp8_gemm.fp8_gemm(a, codes, torch.float32, scales, splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

