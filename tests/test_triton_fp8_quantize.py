"""Triton FP8 row quantization (`backends.triton_kernels.fp8_quantize`) vs `ops.fp8_linear.quantize_rows`.

CPU: the kernel runs in the Triton interpreter in a child process (`interp_triton_fp8_quantize.py`; see
`triton_support.py` for why). GPU: the layer's operand shapes, row-major and transposed, bit for bit, and the
`torch_scaled_mm` backend counting the variant that quantized.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_dsa.backends import reset_call_counts, variant_counts
from megatron_dsa.backends import torch_scaled_mm
from megatron_dsa.backends.triton_kernels import fp8_quantize
from megatron_dsa.ops.fp8_linear import quantize_rows as reference_quantize_rows
from test_fp8_projections import fp8_gpu_or_skip
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)


def test_interpreted_kernel():
    run_interpreted("interp_triton_fp8_quantize.py")


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="cannot run on t's device"):
        fp8_quantize.quantize_rows(torch.randn(4, 16), 4, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,transposed", [((4096, 4096), False), ((4096, 32768), True), ((1024, 4096), True),
                                              ((100, 72), False)])
def test_layer_operands_on_gpu_match_the_reference(shape, transposed):
    """bf16 operands of the dsv4-flash projections (a weight, an output gradient read as `dyᵀ`, an input read as
    `xᵀ`, an unaligned one) against torch's quantization on the GPU, bit for bit: scales and e4m3 codes (the
    sign of a zero included: an earlier kernel wrote +0 for tiny negative values, 55 of 16.8 M here)."""
    device = fp8_gpu_or_skip()  # e4m3 conversions need compute capability >= 8.9 in Triton too
    t = torch.randn(shape, device=device, dtype=torch.bfloat16) * 3
    t = t.t() if transposed else t
    rows, width = -(-t.shape[0] // 16) * 16, -(-t.shape[1] // 16) * 16
    q, scale = fp8_quantize.quantize_rows(t, rows, width)
    padded = F.pad(t, (0, width - t.shape[1], 0, rows - t.shape[0]))
    q_want, scale_want = reference_quantize_rows(padded)
    assert torch.equal(scale, scale_want.float()), f"{int((scale != scale_want.float()).sum())} of {rows} scales differ"
    codes, codes_want = q.view(torch.uint8), q_want.view(torch.uint8)
    off = codes != codes_want
    examples = [(int(a), int(b), float(x), float(sc)) for a, b, x, sc in zip(
        codes[off][:5], codes_want[off][:5], padded[off][:5], scale.expand_as(q)[off][:5])]
    assert not off.any(), f"{int(off.sum())} of {q.numel()} codes differ; (code, torch's code, value, scale): {examples}"


@pytest.mark.gpu
def test_scaled_mm_backend_quantizes_with_the_kernel():
    device = fp8_gpu_or_skip()
    a = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    b = torch.randn(128, 256, device=device, dtype=torch.bfloat16)
    reset_call_counts()
    torch_scaled_mm.fp8_gemm(a, b, torch.bfloat16)
    assert variant_counts().get(("torch_scaled_mm", "fp8_gemm", "triton_quantize"), 0) == 1, variant_counts()


@pytest.mark.parametrize("transposed", [False, True])
def test_kernels_compile_for_hopper(transposed, tmp_path):
    """The kernels as a bf16 launch specialises them compile for sm_90a (triton bundles ptxas) without spills:
    the interpreter runs kernels that the compiler refuses (a global that is not a constexpr, for one)."""
    from megatron_dsa.backends.triton_kernels import _fp8_quantize_kernels as kernels
    from triton_support import compile_for_sm90, ptxas_report

    block_r, block_k = fp8_quantize.COLUMN_MAJOR_TILE if transposed else fp8_quantize.ROW_MAJOR_TILE
    strides = dict(STRIDE_R="constexpr", STRIDE_K="i32") if transposed else dict(STRIDE_R="i32", STRIDE_K="constexpr")
    unit = {name: 1 for name, kind in strides.items() if kind == "constexpr"}  # Triton specialises a stride of 1
    tiles = dict(BLOCK_R=block_r, BLOCK_K=block_k)
    amax = compile_for_sm90(kernels, "row_amax_kernel", dict(t_ptr="*bf16", amax_bits_ptr="*i32", R="i32", K="i32",
                            **strides, BLOCK_R="constexpr", BLOCK_K="constexpr"), {**tiles, **unit}, fp8_quantize.WARPS)
    signature = dict(t_ptr="*bf16", amax_bits_ptr="*i32", q_ptr="*fp8e4nv", scale_ptr="*fp32", R="i32", K="i32",
                     **strides, R_OUT="i32", K_OUT="i32", BLOCK_R="constexpr", BLOCK_K="constexpr",
                     FP8_MAX="constexpr", INV_FP8_MAX="constexpr", TINY="constexpr")
    constexprs = dict(**tiles, **unit, FP8_MAX=448.0, INV_FP8_MAX=1 / 448, TINY=torch.finfo(torch.float32).tiny)
    quantize = compile_for_sm90(kernels, "quantize_kernel", signature, constexprs, fp8_quantize.WARPS)
    ptx = quantize.asm["ptx"]
    assert "div.rn.f32" in ptx  # the correctly rounded division the reference's numbers need
    assert "atom.global" in amax.asm["ptx"] and "max" in amax.asm["ptx"]
    for compiled in (amax, quantize):
        assert "0 bytes spill stores" in ptxas_report(compiled.asm["ptx"], tmp_path)
