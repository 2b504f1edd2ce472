"""The non-finite guard's Triton passes (`backends.triton_kernels.non_finite_guard`) against the torch ops they
replace: the stand-in and flags (`ops.dense_attention.finite_stand_in`, `non_finite_heads`) and the fill of the
flagged rows (`torch.where`).

CPU: the kernels run in the Triton interpreter in a child process (`interp_triton_non_finite_guard.py`). GPU: the
M layer's q, k, v and output shapes (dsv4-flash and DeepSeek-V3 dims), bit for bit, and the guard of a fused
dense backend counting its Triton path.
"""

import pytest
import torch

from megatron_dsa.backends import reset_call_counts, variant_counts
from megatron_dsa.backends.dense_layout import isolate_non_finite
from megatron_dsa.backends.triton_kernels.non_finite_guard import fill_flagged, finite_stand_in_with_flags
from megatron_dsa.ops.dense_attention import causal_attention, finite_stand_in, non_finite_heads
from megatron_dsa.ops.layout import TokenLayout
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)


def test_interpreted_kernel():
    run_interpreted("interp_triton_non_finite_guard.py")


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="cannot run on t's device"):
        finite_stand_in_with_flags(torch.randn(4, 2, 16))
    with pytest.raises(ValueError, match="cannot run on t's device"):
        fill_flagged(torch.randn(4, 2, 16), torch.zeros(4, 2, dtype=torch.bool), 0.0)


def test_bad_shapes_and_dtypes_are_named():
    with pytest.raises(ValueError, match=r"t \[R, H, D\]"):
        finite_stand_in_with_flags(torch.randn(4, 16))
    with pytest.raises(TypeError, match="supports"):
        finite_stand_in_with_flags(torch.zeros(4, 2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"flagged \[R, H\] bool"):
        fill_flagged(torch.randn(4, 2, 16), torch.zeros(4, 3, dtype=torch.bool), 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,slice_of", [((4096, 64, 512), None), ((4096, 128, 192), None),
                                            ((4096, 128, 128), 256), ((1000, 3, 40), None)])
def test_layer_shapes_on_gpu_match_the_torch_ops(shape, slice_of):
    """q / k / v / out of dsv4-flash's M (64 heads, 448 + 64, v 512) and DeepSeek-V3's (128 heads, 128 + 64), V3's v
    as the head slice of its up-projection's `[T, 128, 256]` rows, an odd shape; bf16 with non-finite values."""
    rows, heads, width = shape
    wide = torch.randn(rows, heads, slice_of or width, device="cuda", dtype=torch.bfloat16)
    t = wide[..., -width:]
    flat = wide.view(-1, wide.shape[-1])
    flat[7, -1], flat[1234 % flat.shape[0], -2], flat[-1, -width] = float("nan"), float("inf"), float("-inf")
    stand_in, flags = finite_stand_in_with_flags(t)
    assert torch.equal(stand_in.view(torch.int16), finite_stand_in(t).contiguous().view(torch.int16))
    assert torch.equal(flags, non_finite_heads(t)) and int(flags.sum()) == 3
    dead = flags.clone()
    dead[::97] = True  # rows that see a bad key are filled too, not only those holding one
    for fill in (float("nan"), 0.0):
        want = torch.where(dead.unsqueeze(-1), fill, t)
        assert same_bits_or_both_nan(fill_flagged(t, dead, fill), want)


def same_bits_or_both_nan(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN's payload may differ: the kernel writes bf16 `0x7FFF` where `torch.where`
    writes the canonical `0x7FC0` (both quiet NaNs; nothing downstream reads the payload)."""
    nan = torch.isnan(want)
    bits = (got.view(torch.int16), want.contiguous().view(torch.int16))
    return torch.equal(torch.isnan(got), nan) and torch.equal(bits[0][~nan], bits[1][~nan])


@pytest.mark.gpu
def test_the_guard_takes_its_triton_passes_on_gpu():
    """A guarded kernel (the reference attention) on CUDA: the guard counts its Triton path once per call, and its
    output and input gradients equal the unguarded reference's on finite inputs."""
    layout = TokenLayout.packed(torch.tensor([0, 40, 64], dtype=torch.int32), 64, torch.device("cuda"))
    q, k, v = (torch.randn(64, 4, 32, device="cuda", requires_grad=True) for _ in range(3))
    reset_call_counts()
    out, lse = isolate_non_finite(causal_attention)(q, k, v, layout, 0.2)
    assert variant_counts() == {("triton", "dense_attention", "non_finite_guard"): 1}
    want, want_lse = causal_attention(q, k, v, layout, 0.2)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(grads, torch.autograd.grad(want.sum(), (q, k, v)), rtol=0, atol=0)


@pytest.mark.parametrize("kernel_name", ["finite_stand_in_kernel", "fill_flagged_kernel"])
@pytest.mark.parametrize("width", [512, 192, 128])
def test_kernels_compile_for_hopper_without_spills(kernel_name, width, tmp_path):
    """The kernels as a bf16 launch at the M layer's widths specialises them compile for sm_90a without spills
    (the interpreter runs kernels that the compiler refuses)."""
    from megatron_dsa.backends.triton_kernels import _non_finite_guard_kernels as kernels
    from megatron_dsa.backends.triton_kernels.rope import row_block
    from triton_support import compile_for_sm90, ptxas_report

    block_d, block_n, warps = row_block(width)
    pointers = (dict(t_ptr="*bf16", out_ptr="*bf16", flags_ptr="*i8") if kernel_name == "finite_stand_in_kernel"
                else dict(t_ptr="*bf16", flags_ptr="*i8", out_ptr="*bf16", fill="fp32"))
    signature = dict(**pointers, N="i32", H="i32", ROW_STRIDE="i32", HEAD_STRIDE="i32", D="constexpr",
                     BLOCK_N="constexpr", BLOCK_D="constexpr")
    compiled = compile_for_sm90(kernels, kernel_name, signature, dict(D=width, BLOCK_N=block_n, BLOCK_D=block_d),
                                warps)
    report = ptxas_report(compiled.asm["ptx"], tmp_path)
    assert " 0 bytes spill stores" in report, report
