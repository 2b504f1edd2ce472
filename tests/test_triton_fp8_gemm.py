"""The few-rows Triton FP8 GEMM (`backends.triton_kernels.fp8_gemm`) vs `ops.fp8_linear.fp8_gemm_reference`.

CPU: the kernels run in the Triton interpreter in a child process (`interp_triton_fp8_gemm.py`), and compile for
sm_90a as a decode step launches them. GPU: a decode step's shapes against the reference, replays of a captured
graph (the split tiles' tickets), and a layer's decode steps dispatched to the kernel by `auto`, its prefill to
cuBLASLt, against the same steps on cuBLASLt only.
"""

import re

import pytest
import torch

from megatron_dsa import HybridAttention
from megatron_dsa.backends import call_counts, reset_call_counts
from megatron_dsa.backends import triton as triton_backend
from megatron_dsa.backends.registry import OpFamily
from megatron_dsa.backends.triton_kernels import fp8_gemm
from megatron_dsa.layers.decoding import LayerCache
from megatron_dsa.ops.fp8_linear import fp8_gemm_reference, quantize_rows
from test_fp8_projections import fp8_gpu_or_skip, relative_error, tiny
from triton_support import compile_for_sm90, ptxas_report, run_interpreted, without_interpreter  # noqa: F401

# A bf16 output is the reference's value rounded to bf16, or its neighbour (2⁻⁸ relative); see the GPU test for the
# absolute part.
BF16_STEP = 2.0 ** -8
ATOL_OF_MAX = 2.0 ** -10


def test_interpreted_kernels():
    run_interpreted("interp_triton_fp8_gemm.py")


@pytest.mark.parametrize("block_m, splits", [(16, 1), (64, 1), (32, 4)])
def test_gemm_compiles_for_sm90_on_e4m3_wgmma_pipelined_without_spills(block_m, splits, tmp_path):
    """As a decode step launches it (K a whole number of steps): the products run on e4m3 warpgroup MMAs, the
    loads are asynchronous copies the pipeliner issues ahead, nothing spills, and three programs fit a
    multiprocessor's shared memory (228 KiB, 1 KiB of it reserved per program; four below 64 rows)."""
    from megatron_dsa.backends.triton_kernels import _fp8_gemm_kernels as kernels

    signature = dict(a_ptr="*fp8e4nv", a_scale_ptr="*fp32", b_ptr="*fp8e4nv", b_scale_ptr="*fp32", out_ptr="*bf16",
                     partials_ptr="*fp32", tickets_ptr="*i32", M="i32", N="i32", K="i32", G="i32", K_PER_SPLIT="i32",
                     SPLITS="constexpr", EVEN_K="constexpr", BLOCK_N="constexpr", BLOCK_M="constexpr",
                     BLOCK_K="constexpr", PRECISE_EVERY="constexpr", CHAINED="constexpr")
    constexprs = dict(SPLITS=splits, EVEN_K=True, BLOCK_N=fp8_gemm.BLOCK_N, BLOCK_M=block_m, BLOCK_K=fp8_gemm.BLOCK_K,
                      PRECISE_EVERY=fp8_gemm.PRECISE_EVERY, CHAINED=True)  # a Hopper launch is chained
    compiled = compile_for_sm90(kernels, "few_rows_gemm_kernel", signature, constexprs, fp8_gemm.WARPS,
                                fp8_gemm.STAGES)
    ptx = compiled.asm["ptx"]
    assert re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx) and "cp.async" in ptx
    assert "0 bytes spill stores" in ptxas_report(ptx, tmp_path)
    assert (3 if block_m == 64 else 4) * (compiled.metadata.shared + 1024) <= 228 * 1024, compiled.metadata.shared


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="triton fp8 gemm cannot run on a's device"):
        fp8_gemm.fp8_gemm(torch.randn(2, 32), torch.randn(8, 32), torch.float32)


@pytest.mark.parametrize("a, b, scales, out_dtype, error, message", [
    ((2, 32), (8, 16), None, torch.float32, ValueError, r"must share K .*got a \(2, 32\) and b \(8, 16\)"),
    ((2, 32), (8, 32), None, torch.float64, TypeError, "out_dtype torch.float64"),
    ((2, 32), (8, 32), (8, 1), torch.float32, ValueError, "b must be e4m3 codes"),
], ids=["k_differs", "float64_output", "scales_without_codes"])
def test_bad_inputs_are_named(a, b, scales, out_dtype, error, message):
    with pytest.raises(error, match=message):
        fp8_gemm.fp8_gemm(torch.randn(a), torch.randn(b), out_dtype, None if scales is None else torch.ones(scales))


def test_auto_takes_the_kernel_for_a_known_few_rows_only():
    """The probe's own rule (`auto` on a GPU): up to 64 rows; unknown or more rows go to cuBLASLt; named, any."""
    rule = triton_backend._fp8_gemm_problem
    assert rule({"rows": 32}, explicit=False) is None and rule({"rows": 64}, explicit=False) is None
    assert rule({"rows": 65}, explicit=False) == rule({"rows": 4096}, explicit=False)  # logged once, not per shape
    assert "more rows: `auto` takes it for at most 64 rows, cuBLASLt's" in rule({"rows": 65}, explicit=False)
    assert "rows unknown" in rule({}, explicit=False)
    assert rule({"rows": 4096}, explicit=True) is None


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32, 64])
@pytest.mark.parametrize("outputs, width, groups", [(1024, 4096, 1), (32768, 1024, 1), (4096, 8192, 1), (72, 200, 1),
                                                    (1024, 4096, 8)],
                         ids=["q_down", "q_up", "o_proj", "unaligned", "o_group"])
def test_decode_shapes_match_the_reference_on_the_gpu(rows, outputs, width, groups):
    """dsv4-flash's decode projections (kept codes, as through an inference cache; the grouped output projection's
    8 groups in one call) and an unaligned shape, bf16 output. Tolerances: the output's bf16 rounding (`BF16_STEP`
    relative per element; 1.7e-3 relative over the whole output, as cuBLASLt's), and the FP8 MMAs' sums, which
    are float32 only every 32 products (4.6e-5 relative measured over the output: `ATOL_OF_MAX` of the largest
    output covers an element near zero). The weight rounded in the call gives the same bits as its kept codes."""
    device = fp8_gpu_or_skip()
    a = torch.randn(rows, groups * width, device=device, dtype=torch.bfloat16)
    weight = torch.randn(groups * outputs, width, device=device, dtype=torch.bfloat16)
    codes, scales = quantize_rows(weight)
    if groups > 1:
        codes, scales = codes.view(groups, outputs, width), scales.view(groups, outputs, 1)
    got = fp8_gemm.fp8_gemm(a, codes, torch.bfloat16, scales)
    want = fp8_gemm_reference(a, codes, torch.float32, scales)
    torch.testing.assert_close(got.float(), want, rtol=BF16_STEP, atol=ATOL_OF_MAX * want.abs().max().item())
    assert relative_error(got.float(), want) < 3e-3
    if groups == 1:
        assert torch.equal(fp8_gemm.fp8_gemm(a, weight, torch.bfloat16), got)


@pytest.mark.gpu
def test_split_gemms_replay_in_a_cuda_graph():
    """Split tiles leave their tickets at zero: eager calls, a captured graph's replays and eager calls again give
    the same bits (the partials are summed in split order, whichever split finished last)."""
    device = fp8_gpu_or_skip()
    assert fp8_gemm.split_count(8 * 1024 // fp8_gemm.BLOCK_N, 4096 // fp8_gemm.BLOCK_K, device) > 1
    a = torch.randn(32, 8 * 4096, device=device, dtype=torch.bfloat16)
    codes, scales = quantize_rows(torch.randn(8 * 1024, 4096, device=device, dtype=torch.bfloat16))
    codes, scales = codes.view(8, 1024, 4096), scales.view(8, 1024, 1)  # the grouped output projection
    eager = fp8_gemm.fp8_gemm(a, codes, torch.bfloat16, scales)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_gemm.fp8_gemm(a, codes, torch.bfloat16, scales)  # the capture stream's tickets, before capturing
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = fp8_gemm.fp8_gemm(a, codes, torch.bfloat16, scales)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    assert torch.equal(fp8_gemm.fp8_gemm(a, codes, torch.bfloat16, scales), eager)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", "WC")
def test_auto_decodes_on_the_kernel_and_prefills_on_cublaslt(kind):
    """A bf16 layer with FP8 projections: the prefill's many rows go to `torch_scaled_mm`, each decode step's two
    rows to the Triton kernel (counted), and every step agrees with the same steps on `torch_scaled_mm` alone
    (same rounding, another summation order: the outputs' relative error is a few bf16 steps)."""
    device = fp8_gpu_or_skip()
    torch.manual_seed(0)
    config = tiny(kind, projection_precision="fp8", dsa_indexer_topk=128)  # every entry kept: no selection flips
    layer = HybridAttention(config, kind=kind).to(device).bfloat16().eval()
    cublas = HybridAttention(config.replace(attention_backend_overrides={"fp8_gemm": "torch_scaled_mm"}),
                             kind=kind).to(device).bfloat16().eval()
    cublas.load_state_dict(layer.state_dict())
    x = torch.randn(40, 2, 128, device=device, dtype=torch.bfloat16)
    outputs = {}
    for name, model in (("auto", layer), ("cublas", cublas)):
        cache = LayerCache.for_layer(model, batch=2, capacity=48)
        with torch.no_grad():
            reset_call_counts()
            prefill, _ = model(x[:36], inference_cache=cache)
            prefill_counts = call_counts()
            reset_call_counts()
            steps = [model(x[t:t + 1], inference_cache=cache)[0] for t in range(36, 40)]
            step_counts = call_counts()
        outputs[name] = torch.cat([prefill, *steps])
        if name == "auto":
            assert prefill_counts.get(("torch_scaled_mm", "fp8_gemm"), 0) > 0
            assert ("triton", "fp8_gemm") not in prefill_counts
            assert step_counts.get(("triton", "fp8_gemm"), 0) >= 4 * 3
            assert ("torch_scaled_mm", "fp8_gemm") not in step_counts
    assert relative_error(outputs["auto"], outputs["cublas"]) < 0.02
