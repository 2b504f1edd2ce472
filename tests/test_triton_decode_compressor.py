"""A decode step's compressor write (`ops.decode_compressor.decode_compress`, the Triton kernel
`backends/triton_kernels/decode_compressor.py`): the new token into its pending slot, its group's entry pooled,
normalised, rotated (Hadamard for the indexer's keys), rounded (an FP8 store) and stored, in one launch.

The CPU cases of the kernel run in the Triton interpreter in a child process (`interp_triton_decode_compressor.py`;
`triton_support.py` says why a child process). Here: the sm_90a compile, dispatch (an explicit request that cannot
run; `auto` declining what the kernel does not take) and the GPU tests (`gpu` marker), tolerances stated where used.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa.backends import BackendUnavailableError, call_counts, dispatch, reset_call_counts
from megatron_dsa.backends.registry import OpFamily
from megatron_dsa.layers.kinds import build_attention
from megatron_dsa.ops.decode_compressor import decode_compress as reference_write
from megatron_dsa.ops.decode_compressor import pending_slots
from megatron_dsa.ops.indexer import FP8_KEYS
from megatron_dsa.ops.rope import plain_inv_freq
from interp_triton_decode_attention import decoding_config
from triton_support import compile_for_sm90, ptxas_report, run_interpreted, without_interpreter  # noqa: F401

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# dsv4-flash's compressors: the attention's (ratio 4, Dc 512) and an H layer's (ratio 128), the indexer's keys
# (ratio 4, Dc 128, Hadamard; bf16 or FP8).
DSV4_WRITES = [(4, 512, False, False), (128, 512, False, False), (4, 128, True, False), (4, 128, True, True)]
DSV4_IDS = ["C_entries", "H_entries", "C_indexer_keys", "C_indexer_keys_fp8"]


def test_interpreter_cases():
    """The kernel against the reference op, and C / H decode steps through it against the reference decode (fp32,
    interpreter), in a child process."""
    run_interpreted("interp_triton_decode_compressor.py")


@pytest.mark.parametrize("ratio, dc, rotate, fp8, stage", [
    (4, 512, False, False, 0), (4, 128, True, False, 0), (4, 128, True, True, 0), (128, 512, False, False, 1),
    (128, 512, False, False, 2)], ids=["C_entries", "C_indexer_keys", "C_indexer_keys_fp8", "H_pool", "H_finish"])
def test_kernel_compiles_for_sm90_without_spills(ratio, dc, rotate, fp8, stage, tmp_path):
    """Each launch a dsv4 decode step makes compiles for sm_90a (triton bundles ptxas) with nothing spilled: the
    entry and one tile of slot rows stay in registers (H's long group: its split launches)."""
    import triton.language as tl

    from megatron_dsa.backends.triton_kernels import _decode_compressor_kernels as kernels
    from megatron_dsa.backends.triton_kernels import decode_compressor as launches

    signature = dict(state_ptr="*bf16", new_ptr="*bf16", pos_ptr="*i64", ape_ptr="*fp32", w_ptr="*bf16",
                     freq_ptr="*fp32", eps_ptr="*fp32", store_ptr="*fp8e4nv" if fp8 else "*bf16",
                     scale_ptr="*fp32", counts_ptr="*i32", pooled_ptr="*bf16", NEW_STRIDE="i32", ENTRIES="i32")
    block_p = min(dc // 2, launches.SPLIT_PAIRS) if stage == 1 else dc // 2
    constexprs = dict(SLOTS=pending_slots(ratio), RATIO=ratio, COFF=2 if ratio == 4 else 1, DC=dc, HALF=32,
                      ROTATE=rotate, FP8=fp8, STAGE=stage, BLOCK_S=launches._slot_block(ratio, block_p),
                      BLOCK_P=block_p, BLOCK_ROW=launches.BLOCK_ROW, LOG2_P=block_p.bit_length() - 1,
                      HADAMARD_SCALE=dc ** -0.5, FP8_MAX=448.0, INV_FP8_MAX=1.0 / 448.0,
                      TINY=torch.finfo(torch.float32).tiny,
                      COUNTS=rotate,  # the indexer's write (the rotated one) writes the entry counts too
                      COMPUTE=tl.float32,
                      CHAINED=True)  # a Hopper launch is chained
    signature.update({name: "constexpr" for name in constexprs})
    warps = launches.POOL_WARPS if stage == 1 else launches.WARPS
    compiled = compile_for_sm90(kernels, "decode_compress_kernel", signature, constexprs, warps, 1)
    assert "0 bytes spill stores" in ptxas_report(compiled.asm["ptx"], tmp_path)


def test_an_explicit_triton_request_that_cannot_run_says_why(without_interpreter, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = decoding_config("C").replace(attention_backend_overrides={"decode_compressor": "triton"})
    with pytest.raises(BackendUnavailableError, match="'triton' cannot run decode_compressor: tensors on cpu"):
        build_attention(config, kind="C")


def test_the_triton_probe_declines_a_hadamard_the_kernel_does_not_hold(monkeypatch):
    """On a (pretended) GPU: a rotated entry wider than the kernel's in-register Hadamard is declined with the
    reason (`auto` then runs the reference; a request by name fails with it); the indexer's 128 is taken."""
    from megatron_dsa.backends import triton as triton_backend
    from megatron_dsa.backends import triton_kernels

    monkeypatch.setattr(triton_kernels.availability, "triton_decline_reason", lambda device, explicit=False: None)
    monkeypatch.setattr(triton_backend, "triton_decline_reason", lambda device, explicit=False: None)
    call = dict(device=torch.device("cuda"), dtype=torch.bfloat16, ratio=4, head_dim=512, rotate=True,
                key_dtype=torch.bfloat16)
    reason = triton_backend.probe(OpFamily.DECODE_COMPRESSOR, call)
    assert reason is not None and "power-of-two head dims up to 256, got 512" in reason
    assert triton_backend.probe(OpFamily.DECODE_COMPRESSOR, {**call, "head_dim": 128}) is None
    assert triton_backend.probe(OpFamily.DECODE_COMPRESSOR, {**call, "rotate": False}) is None


def gpu_write_inputs(ratio: int, dc: int, fp8: bool, batch: int = 32, context: int = 131072) -> dict:
    """dsv4-flash buffers of `batch` sequences with a `context`-token capacity, bf16 (ape float32, as the layer
    keeps it), random slots and stores, and new tokens at positions spread over the cache (the first, group
    ends and starts, deep ones)."""
    g = torch.Generator(device="cuda").manual_seed(ratio + dc)
    coff = 2 if ratio == 4 else 1
    width, entries = coff * dc, context // ratio
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    store = randn(batch, entries, dc).bfloat16()
    scales = None
    if fp8:
        store, scales = (store / 448).to(FP8_KEYS), torch.rand(batch, entries, device="cuda", generator=g) + 0.5
    positions = torch.randint(0, context, (batch,), device="cuda", generator=g)
    positions[:6] = torch.tensor([0, 3, 4, ratio - 1, ratio, context - 1])
    return dict(state=randn(batch, pending_slots(ratio), 2 * width).bfloat16(),
                new_rows=randn(batch, 2 * width).bfloat16(), positions=positions,
                ape=randn(ratio, width) * 0.5,
                norm_weight=(torch.rand(dc, device="cuda", generator=g) + 0.5).bfloat16(),
                eps=1e-6, inv_freq=plain_inv_freq(64, base=10000.0).float().cuda(), store=store, scales=scales,
                counts=torch.full((batch,), -7, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ratio, dc, rotate, fp8", DSV4_WRITES, ids=DSV4_IDS)
@torch.no_grad()
def test_bf16_kernel_writes_what_the_reference_writes_on_the_gpu(ratio, dc, rotate, fp8):
    """The kernel (dispatched under `auto` and counted) against the reference op on the same bf16 buffers, both on
    the GPU. The slot rows are copies: equal. Entries: both round the pooled row, the normalised row and each RoPE
    product to bf16 at the same points, but sum in another order (softmax, RMSNorm, Hadamard), so a rounding may
    fall on the other side: one bf16 ulp (2⁻⁸ relative) per rounding step, four of them: rtol 2⁻⁶, atol 2⁻⁸ for
    values near 0 (entries are of order 1 after the norm). FP8: the scales as the values they are the amax of
    (rtol 2⁻⁶), the dequantized codes within that bf16 tolerance plus one e4m3 step (2⁻³ of the value, or the
    subnormal step 2⁻⁹ of the scale), nine in ten codes equal."""
    inputs = gpu_write_inputs(ratio, dc, fp8)
    buffers = []
    for backend in ("unfused", "auto"):
        run = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        write = dispatch(OpFamily.DECODE_COMPRESSOR, backend, device=run["state"].device, dtype=torch.bfloat16,
                         ratio=ratio, head_dim=dc, rotate=rotate, key_dtype=run["store"].dtype)
        reset_call_counts()
        write(**run, rotate=rotate)
        buffers.append(run)
    assert call_counts() == {("triton", "decode_compressor"): 1}, call_counts()
    expected, got = buffers
    assert torch.equal(got["state"], expected["state"])
    assert torch.equal(got["counts"], expected["counts"])
    assert torch.equal(got["counts"], ((inputs["positions"] + 1) // ratio).int())
    rows = torch.arange(32, device="cuda"), inputs["positions"] // ratio
    untouched = torch.ones(inputs["store"].shape[:2], dtype=torch.bool, device="cuda")
    untouched[rows] = False
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype == FP8_KEYS else t  # noqa: E731
    assert torch.equal(as_bytes(got["store"])[untouched], as_bytes(inputs["store"])[untouched])
    if not fp8:
        torch.testing.assert_close(got["store"][rows].float(), expected["store"][rows].float(), rtol=2 ** -6,
                                   atol=2 ** -8)
        return
    torch.testing.assert_close(got["scales"][rows], expected["scales"][rows], rtol=2 ** -6, atol=0)
    values = [b["store"][rows].float() * b["scales"][rows].unsqueeze(-1) for b in (expected, got)]
    # The bf16 rows being encoded may differ as above (an ulp of an order-1 input moves a Hadamard output near 0
    # by ~2⁻⁸ / sqrt(128) absolutely, many e4m3 steps of a small value), then one e4m3 step each way.
    step = values[0].abs() * (2 ** -3 + 2 ** -6) + 2 ** -8 + expected["scales"][rows].unsqueeze(-1) * 2 ** -9
    assert ((values[1] - values[0]).abs() <= step).all(), float(((values[1] - values[0]).abs() - step).max())
    assert (as_bytes(got["store"][rows]) == as_bytes(expected["store"][rows])).float().mean() > 0.9
