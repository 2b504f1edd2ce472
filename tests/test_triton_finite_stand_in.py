"""The non-finite guard's one-pass Triton kernel (`backends.triton_kernels.finite_stand_in`) against the torch
ops it replaces (`ops.dense_attention.finite_stand_in`, `non_finite_heads`).

CPU: the kernel runs in the Triton interpreter in a child process (`interp_triton_finite_stand_in.py`). GPU:
the M layer's q, k and v shapes (dsv4-flash and DeepSeek-V3 dims), bit for bit, and the guard of a fused dense
backend counting the kernel.
"""

import pytest
import torch

from megatron_dsa.backends import reset_call_counts, variant_counts
from megatron_dsa.backends.dense_layout import stand_in_and_flags
from megatron_dsa.backends.triton_kernels.finite_stand_in import finite_stand_in_with_flags
from megatron_dsa.ops.dense_attention import finite_stand_in, non_finite_heads
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)


def test_interpreted_kernel():
    run_interpreted("interp_triton_finite_stand_in.py")


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="cannot run on t's device"):
        finite_stand_in_with_flags(torch.randn(4, 2, 16))


def test_bad_shapes_and_dtypes_are_named():
    with pytest.raises(ValueError, match=r"t \[R, H, D\]"):
        finite_stand_in_with_flags(torch.randn(4, 16))
    with pytest.raises(TypeError, match="supports"):
        finite_stand_in_with_flags(torch.zeros(4, 2, 16, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,slice_of", [((4096, 64, 512), None), ((4096, 128, 192), None),
                                            ((4096, 128, 128), 256), ((1000, 3, 40), None)])
def test_layer_shapes_on_gpu_match_the_torch_ops(shape, slice_of):
    """q / k of dsv4-flash's M (64 heads, 448 + 64) and DeepSeek-V3's (128 heads, 128 + 64), V3's v as the
    head slice of its up-projection's `[T, 128, 256]` rows, an odd shape; bf16 with non-finite values."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows, heads, width = shape
    wide = torch.randn(rows, heads, slice_of or width, device="cuda", dtype=torch.bfloat16)
    t = wide[..., -width:]
    flat = wide.view(-1, wide.shape[-1])
    flat[7, -1], flat[1234 % flat.shape[0], -2], flat[-1, -width] = float("nan"), float("inf"), float("-inf")
    stand_in, flags = finite_stand_in_with_flags(t)
    assert torch.equal(stand_in.view(torch.int16), finite_stand_in(t).contiguous().view(torch.int16))
    assert torch.equal(flags, non_finite_heads(t)) and int(flags.sum()) == 3


@pytest.mark.gpu
def test_the_guard_runs_the_kernel_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reset_call_counts()
    stand_in_and_flags(torch.randn(64, 4, 32, device="cuda"))
    assert variant_counts() == {("triton", "dense_attention", "non_finite_guard"): 1}


@pytest.mark.parametrize("width", [512, 192, 128])
def test_kernel_compiles_for_hopper_without_spills(width, tmp_path):
    """The kernel as a bf16 launch at the M layer's widths specialises it compiles for sm_90a without spills (the
    interpreter runs kernels that the compiler refuses)."""
    from megatron_dsa.backends.triton_kernels import _finite_stand_in_kernels as kernels
    from megatron_dsa.backends.triton_kernels.rope import row_block
    from triton_support import compile_for_sm90, ptxas_report

    block_d, block_n, warps = row_block(width)
    signature = dict(t_ptr="*bf16", out_ptr="*bf16", flags_ptr="*i8", N="i32", H="i32", ROW_STRIDE="i32",
                     HEAD_STRIDE="i32", D="constexpr", BLOCK_N="constexpr", BLOCK_D="constexpr")
    compiled = compile_for_sm90(kernels, "finite_stand_in_kernel", signature,
                                dict(D=width, BLOCK_N=block_n, BLOCK_D=block_d), warps)
    report = ptxas_report(compiled.asm["ptx"], tmp_path)
    assert " 0 bytes spill stores" in report, report
