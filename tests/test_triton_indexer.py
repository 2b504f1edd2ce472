"""Triton lightning-indexer scores vs the unfused reference (`megatron_dsa.ops.indexer`).

CPU: the kernels run in the Triton interpreter in a child process (`interp_triton_indexer.py`; see
`triton_support.py` for why); the forward compiles for sm_90 without spills, the backward within its
register budget. GPU: dsv4 dims, float32 and bfloat16 inputs vs the reference in float32; packed sequences.
"""

import re

import pytest
import torch

from megatron_dsa.backends.triton_kernels import indexer as triton_indexer
from megatron_dsa.ops.indexer import indexer_scores as reference_scores
from distributed import cosine
from indexer_cases import SCALE, causal_candidates, inputs, packed_candidates, random_candidates, run
import triton_support
from triton_support import ptxas_report, run_interpreted, without_interpreter  # noqa: F401  (fixture)

MAX_BACKWARD_SPILL_BYTES = 128  # per thread; see test_backward_compiles_for_sm90_within_its_register_budget


def test_interpreted_kernels():
    run_interpreted("interp_triton_indexer.py")


def compile_for_sm90(kernel_name: str, signature: dict, constexprs: dict, num_warps: int):
    from megatron_dsa.backends.triton_kernels import _indexer_kernels as kernels

    return triton_support.compile_for_sm90(kernels, kernel_name, signature, constexprs, num_warps)


def test_forward_compiles_for_sm90_on_wgmma_without_spills(tmp_path):
    """The bf16 forward at dsv4 indexer dims compiles for sm_90a (triton bundles ptxas), specialised as a
    launch specialises it: its per-head dots run on wgmma and nothing spills (4 warps hold a [64, 64]
    float32 tile of scores and one of dots, the run bookkeeping and the row-by-row path's registers)."""
    signature = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*bf16", cand_ptr="*i64", out_ptr="*fp32", T="i32",
                     Tc="i32", C="i32", HI="i32", DI="i32", scale="fp32", BLOCK_R="constexpr", BLOCK_H="constexpr",
                     BLOCK_D="constexpr", BLOCK_C="constexpr", MAX_RUNS="constexpr", PRECISION="constexpr")
    constexprs = dict(BLOCK_R=triton_indexer.FORWARD_ROWS, BLOCK_H=64, BLOCK_D=128,
                      BLOCK_C=triton_indexer.BLOCK_C[torch.bfloat16], MAX_RUNS=triton_indexer.FORWARD_RUNS,
                      PRECISION="tf32")
    compiled = compile_for_sm90("indexer_forward_kernel", signature, constexprs, triton_indexer.FORWARD_WARPS)
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    report = ptxas_report(compiled.asm["ptx"], tmp_path)
    assert "0 bytes spill stores" in report, report


@pytest.mark.parametrize("kl", [False, True])
def test_backward_compiles_for_sm90_within_its_register_budget(kl, tmp_path):
    """The bf16 backward (and its KL form) at dsv4 indexer dims, 4 warps: q, the dq accumulator and a
    block's dots, keys and dk share 255 registers per thread; a few dozen bytes spill (4–52 depending on
    the ptxas version), measured fast on Hopper. A change that spills hundreds of bytes per thread
    fails here before it costs time on a GPU."""
    signature = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*bf16", cand_ptr="*i64", grad_ptr="*fp32",
                     target_ptr="*fp32", row_weight_ptr="*fp32", dq_ptr="*bf16", dw_ptr="*bf16", dk_ptr="*fp32",
                     C="i32", HI="i32", DI="i32", scale="fp32", BLOCK_H="constexpr", BLOCK_D="constexpr",
                     BLOCK_C="constexpr", BLOCK_S="constexpr", KEY_GRAD="constexpr", KL="constexpr",
                     PRECISION="constexpr")
    constexprs = dict(BLOCK_H=64, BLOCK_D=128, BLOCK_C=triton_indexer.BLOCK_C[torch.bfloat16], BLOCK_S=512,
                      KEY_GRAD=True, KL=kl, PRECISION="tf32")
    compiled = compile_for_sm90("indexer_backward_kernel", signature, constexprs, triton_indexer.BACKWARD_WARPS)
    report = ptxas_report(compiled.asm["ptx"], tmp_path)
    spilled = re.search(r"(\d+) bytes spill stores", report)
    assert spilled is not None and int(spilled.group(1)) <= MAX_BACKWARD_SPILL_BYTES, report


def test_cpu_without_interpreter_is_refused(without_interpreter):
    q, k, w = inputs(4, 2, 16, entries=3)
    with pytest.raises(ValueError, match="cannot run on q's device"):
        triton_indexer.indexer_scores(q, k, w, random_candidates(4, 5, 3), SCALE)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dsv4_dims_on_gpu(dtype):
    """T=4096, HI=64, DI=128, C=1024 causal-range candidates, vs the reference in float32 on the same
    (dtype-rounded) inputs. Scores: products of 16-bit values are exact in float32, so only the order
    of float32 additions differs: max error ≤ 1e-4 of the largest score. Gradients: the kernels cast
    the per-head grad of the dots to the input dtype before the dq/dk dots (bf16: 2^-9 relative) and
    round dq/dk/dweights to it: cosine > 0.9999 and norm ratio within 1e-2 (fp32: 1e-5, 1e-4).
    """
    pytest.importorskip("triton")
    q, k, w = inputs(4096, 64, 128, entries=1024, dtype=dtype, device="cuda")
    cand = causal_candidates(4096, 1024).cuda()
    upstream = torch.randn(cand.shape, device="cuda")
    got, got_grads = run(triton_indexer.indexer_scores, q, k, w, cand, upstream)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, w)]
    ref, ref_grads = run(reference_scores, *ref_inputs, cand, upstream)
    valid = cand >= 0
    assert torch.isneginf(got[~valid]).all()
    error = (got[valid] - ref[valid]).abs().max() / ref[valid].abs().max()
    assert error < 1e-4, f"scores: max error {error:.2e} of the largest score"
    bound, ratio_bound = (0.9999, 1e-2) if dtype == torch.bfloat16 else (1 - 1e-5, 1e-4)
    for name, a, b in zip(("q", "k", "weights"), got_grads, ref_grads):
        assert torch.isfinite(a).all(), name
        assert cosine(a, b) > bound, f"grad {name}: cosine {cosine(a, b)}"
        ratio = abs(a.float().norm() / b.norm() - 1)
        assert ratio < ratio_bound, f"grad {name}: norm ratio off by {ratio:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(700, 1300, 2096), (40,) * 30 + (2896,)])
def test_packed_sequences_on_gpu(lengths):
    """Packed sequences at dsv4 dims in bf16: tiles inside one sequence or straddling two take the shared
    key path, tiles over many 40-token sequences the row-by-row one; scores as in `test_dsv4_dims_on_gpu`
    (max error ≤ 1e-4 of the largest score, against the reference in float32 on the same inputs)."""
    pytest.importorskip("triton")
    cand = packed_candidates(lengths).cuda()
    q, k, w = inputs(sum(lengths), 64, 128, entries=int(cand.max()) + 1, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        got = triton_indexer.indexer_scores(q, k, w, cand, SCALE)
        ref = reference_scores(q.float(), k.float(), w.float(), cand, SCALE)
    valid = cand >= 0
    assert torch.equal(torch.isneginf(got), ~valid)
    error = (got[valid] - ref[valid]).abs().max() / ref[valid].abs().max()
    assert error < 1e-4, f"scores: max error {error:.2e} of the largest score"
