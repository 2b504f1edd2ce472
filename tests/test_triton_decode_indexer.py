"""Decode indexer scores (`ops.indexer.decode_indexer_scores`, the Triton kernel
`backends/triton_kernels/decode_indexer.py`): one query row per cached sequence against its own compressed keys.

The CPU cases of the kernel run in the Triton interpreter in a child process (`interp_triton_decode_indexer.py`;
`triton_support.py` says why a child process). Here: dispatch (auto on the CPU, an explicit request that cannot
run, the counters of a decode step) and the GPU test (`gpu` marker) with its tolerance stated where it is used.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa.backends import BackendUnavailableError
from megatron_dsa.layers.kinds import build_attention
from megatron_dsa.ops.indexer import decode_indexer_scores as reference_scores
from interp_triton_decode_attention import decoding_config
from triton_support import compile_for_sm90, ptxas_report, run_interpreted, without_interpreter  # noqa: F401

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_interpreter_cases():
    """The kernel against the reference op, and C-layer decode steps through it against the reference decode
    (fp32, interpreter), in a child process."""
    run_interpreted("interp_triton_decode_indexer.py")


@pytest.mark.parametrize("keys_major, fp8_keys", [(True, False), (False, False), (True, True)],
                         ids=["keys_major", "heads_major", "keys_major_fp8_keys"])
def test_kernel_compiles_for_sm90_pipelined_on_wgmma_without_spills(keys_major, fp8_keys, tmp_path):
    """The bf16 kernel at dsv4 indexer dims compiles for sm_90a as a launch specialises it (triton bundles ptxas):
    its dots run on wgmma, the key loads are pipelined (cp.async), nothing spills, and its shared memory lets two
    programs share a multiprocessor (228 KiB per SM, 1 KiB of it reserved per program)."""
    from megatron_dsa.backends.triton_kernels import _decode_indexer_kernels as kernels
    from megatron_dsa.backends.triton_kernels import decode_indexer

    signature = dict(q_ptr="*bf16", k_ptr="*fp8e4nv" if fp8_keys else "*bf16", key_scales_ptr="*fp32",
                     w_ptr="*bf16", counts_ptr="*i64", out_ptr="*fp32", C="i32", HI="i32", DI="i32",
                     W_STRIDE="i32", COLS_PER_PROGRAM="i32", scale="fp32", BLOCK_H="constexpr", BLOCK_D="constexpr",
                     BLOCK_C="constexpr", PRECISION="constexpr", KEYS_MAJOR="constexpr", KEY_SCALES="constexpr",
                     FP8_MAX="constexpr", INV_FP8_MAX="constexpr", TINY="constexpr", CHAINED="constexpr")
    block_c = decode_indexer.FP8_BLOCK_C if fp8_keys else decode_indexer.BLOCK_C[torch.bfloat16]
    constexprs = dict(BLOCK_H=64, BLOCK_D=128, BLOCK_C=block_c, PRECISION="tf32",
                      KEYS_MAJOR=keys_major, KEY_SCALES=fp8_keys, FP8_MAX=448.0, INV_FP8_MAX=1.0 / 448.0,
                      TINY=torch.finfo(torch.float32).tiny, CHAINED=True)  # a Hopper launch is chained
    warps = decode_indexer.FP8_WARPS if fp8_keys else decode_indexer.WARPS
    compiled = compile_for_sm90(kernels, "decode_indexer_scores_kernel", signature, constexprs, warps,
                                decode_indexer.STAGES)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    assert "0 bytes spill stores" in ptxas_report(ptx, tmp_path)
    assert 2 * (compiled.metadata.shared + 1024) <= 228 * 1024, compiled.metadata.shared


def test_an_explicit_triton_request_that_cannot_run_says_why(without_interpreter, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = decoding_config("C").replace(attention_backend_overrides={"decode_indexer_scores": "triton"})
    with pytest.raises(BackendUnavailableError, match="'triton' cannot run decode_indexer_scores: tensors on cpu"):
        build_attention(config, kind="C")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("keys_major", [True, False], ids=["keys_major", "heads_major"])
def test_bf16_triton_decode_scores_match_the_float64_reference_on_the_gpu(keys_major, monkeypatch):
    """dsv4-flash indexer dims (HI = 64, DI = 128, a 32k-entry cache: 128k tokens at ratio 4), 8 sequences with
    ragged counts (none, part of a step, all), default column ranges; bf16 kernel against the float64 reference
    on the same bf16-rounded inputs.

    Tolerance per score: 2⁻¹⁴ · M with M = scale · Σ_h |w_h| Σ_d |q_hd k_d| (float64). The products of bf16
    values are exact in fp32; the dot's 128 and the heads' 64 fp32 additions err by at most
    ~(128 + 64) · 2⁻²⁴ · M ≈ 2⁻¹⁶·⁴ · M. A dropped head or a wrong key moves a score by a fair fraction of M."""
    from megatron_dsa.backends.triton_kernels import decode_indexer
    from megatron_dsa.backends.triton_kernels.decode_indexer import decode_indexer_scores as triton_scores

    monkeypatch.setattr(decode_indexer, "KEYS_MAJOR", keys_major)
    g = torch.Generator(device="cuda").manual_seed(0)
    batch, heads, dim, width = 8, 64, 128, 32768
    q = torch.randn(batch, heads, dim, device="cuda", generator=g).bfloat16()
    keys = torch.randn(batch, width, dim, device="cuda", generator=g).bfloat16()
    weights = torch.randn(batch, heads, device="cuda", generator=g).bfloat16() * heads ** -0.5
    counts = torch.tensor([0, 1, 100, 129, 16000, width - 1, width, width], device="cuda")
    scale = dim ** -0.5
    got = triton_scores(q, keys, weights, counts, scale)
    expected = reference_scores(q.double(), keys.double(), weights.double(), counts, scale)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    magnitude = torch.einsum("bh,bhd,bjd->bj", weights.double().abs() * scale, q.double().abs(), keys.double().abs())
    error = (got.double() - expected).abs()[finite]
    assert (error <= 2 ** -14 * magnitude[finite]).all(), float((error / magnitude[finite]).max())


@pytest.mark.gpu
@needs_gpu
def test_fp8_keys_on_the_gpu_match_the_float64_reference_of_their_codes_and_scales():
    """The same shapes with e4m3 keys and one float32 scale per key (an FP8 cache): the kernel (counted: Triton
    ran, not the fallback; its dot an e4m3 MMA) against the float64 reference over the same key codes and scales
    and the query rows rounded to e4m3 as the contract says (in float32 on the GPU, as the kernel rounds them:
    the same codes). Tolerance as above, with the magnitude over the dequantized values: e4m3 products are exact
    in float32, and the two scales add two float32 products (2⁻²³ relative)."""
    from megatron_dsa.backends import call_counts, dispatch, reset_call_counts
    from megatron_dsa.backends.registry import OpFamily
    from megatron_dsa.ops.fp8_linear import quantize_rows

    g = torch.Generator(device="cuda").manual_seed(1)
    batch, heads, dim, width = 8, 64, 128, 32768
    q = torch.randn(batch, heads, dim, device="cuda", generator=g).bfloat16()
    codes, scales = quantize_rows(torch.randn(batch * width, dim, device="cuda", generator=g).bfloat16())
    codes, scales = codes.view(batch, width, dim), scales.view(batch, width)
    weights = torch.randn(batch, heads, device="cuda", generator=g).bfloat16() * heads ** -0.5
    counts = torch.tensor([0, 1, 100, 129, 16000, width - 1, width, width], device="cuda")
    scale = dim ** -0.5
    score = dispatch(OpFamily.DECODE_INDEXER_SCORES, "auto", device=q.device, dtype=q.dtype, heads=heads,
                     head_dim=dim, key_dtype=codes.dtype)
    reset_call_counts()
    got = score(q, codes, weights, counts, scale, scales)
    assert call_counts() == {("triton", "decode_indexer_scores"): 1}
    keys = codes.double() * scales.double().unsqueeze(-1)
    q_codes, q_scales = quantize_rows(q.float().flatten(0, 1))
    rounded = (q_codes.double() * q_scales.double()).view(q.shape)
    expected = reference_scores(rounded, keys, weights.double(), counts, scale)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    magnitude = torch.einsum("bh,bhd,bjd->bj", weights.double().abs() * scale, rounded.abs(), keys.abs())
    error = (got.double() - expected).abs()[finite]
    assert (error <= 2 ** -14 * magnitude[finite]).all(), float((error / magnitude[finite]).max())
