"""Triton sparse attention kernels (forward and backward) against the unfused reference
`megatron_dsa.ops.sparse_attention` (docs/math.md §7).

The CPU cases run in the Triton interpreter in a child process (`interp_triton_sparse_attention.py`,
see `triton_support.py` for why a child process); this file runs them, checks input validation and the
behaviour without triton or without the interpreter, and holds the GPU comparisons (`gpu` marker)
at up to dsv4-flash sizes, with their tolerances stated where they are used.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import Tensor

import megatron_dsa.backends.triton_kernels.sparse_attention as triton_sparse
from megatron_dsa.backends import OpFamily, variant_counts
from megatron_dsa.backends.triton_kernels.sparse_attention import sparse_attention_forward
from megatron_dsa.layers.cuda_graphs import capture_graph
from interp_triton_sparse_attention import NAMES, make_inputs, reference, run_triton
from triton_support import ptxas_report, run_interpreted, without_interpreter  # noqa: F401  (fixture)

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def test_interpreter_cases():
    """Forward and backward vs the reference in the CPU interpreter (fp32, tiny sizes), in a child process."""
    run_interpreted("interp_triton_sparse_attention.py")


def test_module_imports_without_triton():
    """The package must work without triton: importing the module is fine, a call says why it cannot run."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from megatron_dsa.backends.triton_kernels.sparse_attention import sparse_attention_forward\n"
            "try:\n"
            "    sparse_attention_forward(torch.zeros(1, 1, 16), torch.zeros(2, 16),"
            " torch.zeros(1, 1, dtype=torch.long), torch.zeros(1), 1.0)\n"
            "except ValueError as error:\n"
            "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "triton not importable" in result.stdout


def test_cpu_tensors_without_interpreter_raise_with_reason(without_interpreter):
    query, kv, indices, sink = make_inputs(4, 4, 16, 8, 10)
    with pytest.raises(ValueError, match="triton sparse attention cannot run on query's device"):
        sparse_attention_forward(query, kv, indices, sink, 0.3)


BAD_FORWARD_INPUTS = [  # (argument named in the message, replacement given the good inputs, error)
    ("query", lambda q, kv, idx, sink: dict(query=q[0]), ValueError),
    ("query", lambda q, kv, idx, sink: dict(query=q.to(torch.int32)), TypeError),
    ("query", lambda q, kv, idx, sink: dict(query=q.tolist()), TypeError),
    ("kv", lambda q, kv, idx, sink: dict(kv=kv[:, :8]), ValueError),
    ("kv", lambda q, kv, idx, sink: dict(kv=kv.unsqueeze(0)), ValueError),
    ("kv", lambda q, kv, idx, sink: dict(kv=kv.to(torch.bfloat16)), TypeError),
    ("indices", lambda q, kv, idx, sink: dict(indices=idx.float()), TypeError),
    ("indices", lambda q, kv, idx, sink: dict(indices=idx[:3]), ValueError),
    ("sink", lambda q, kv, idx, sink: dict(sink=sink[:3]), ValueError),
    ("sink", lambda q, kv, idx, sink: dict(sink=sink.long()), TypeError),
    ("scale", lambda q, kv, idx, sink: dict(scale="0.5"), TypeError),
    ("scale", lambda q, kv, idx, sink: dict(scale=math.inf), ValueError),
]


@pytest.mark.parametrize("argument, replace, error", BAD_FORWARD_INPUTS,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(BAD_FORWARD_INPUTS)])
def test_forward_input_validation(argument, replace, error):
    """Checked before any kernel runs, so no interpreter is needed."""
    query, kv, indices, sink = make_inputs(4, 4, 16, 8, 10)
    good = dict(query=query, kv=kv, indices=indices, sink=sink, scale=0.3)
    with pytest.raises(error, match=argument):
        sparse_attention_forward(**{**good, **replace(query, kv, indices, sink)})


def test_autotune_candidates_cap_the_head_block_at_the_head_count():
    pytest.importorskip("triton")
    configs = triton_sparse._cuda_configs(triton_sparse.FORWARD_CONFIGS)

    def head_blocks(heads: int) -> list[int]:
        return [config.kwargs["BLOCK_H"] for config in triton_sparse._prune(configs, {"H": heads, "D": 512})]

    assert head_blocks(64) == [64, 64, 64, 64] and head_blocks(128) == head_blocks(64)
    assert head_blocks(4) == [16, 16, 16, 16] and head_blocks(20) == [32, 32, 32, 32]
    twins = triton_sparse._cuda_configs(((64, 16, 4, 2), (32, 16, 4, 2)))
    assert len(triton_sparse._prune(twins, {"H": 4, "D": 512})) == 1  # both become (16, 16, 4, 2): kept once


def test_autotune_candidates_cap_the_column_chunk_at_the_head_dim():
    pytest.importorskip("triton")
    configs = triton_sparse._cuda_configs(triton_sparse.BACKWARD_CONFIGS)

    def chunks(dim: int) -> list[int]:
        return [config.kwargs["BLOCK_DC"] for config in triton_sparse._prune(configs, {"H": 64, "D": dim})]

    assert chunks(512) == [64, 32, 32, 32] and chunks(576) == chunks(512)
    assert chunks(20) == [32, 32, 32]  # the first two candidates both become (64, 64, 32, 8, 1): kept once


def test_hopper_kernel_limits():
    """The Gluon Hopper kernels take bf16, blocks of 64 heads and D = 512 on sm_90; every other call runs
    the portable kernels, with the reason logged once per pass."""
    pytest.importorskip("triton")
    decline = triton_sparse.hopper_shape_decline
    if triton_sparse._gluon_problem() is None:
        assert decline((9, 0), torch.bfloat16, 64, 512) is None
        assert decline((9, 0), torch.bfloat16, 128, 512) is None
    assert "sm_100" in decline((10, 0), torch.bfloat16, 64, 512)
    assert "sm_80" in decline((8, 0), torch.bfloat16, 64, 512)
    assert "bfloat16 only" in decline((9, 0), torch.float16, 64, 512)
    assert "multiple of 64 heads" in decline((9, 0), torch.bfloat16, 20, 512)
    assert "head dim 512" in decline((9, 0), torch.bfloat16, 64, 576)
    query = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    assert "needs CUDA" in triton_sparse.hopper_decline(query)
    with triton_sparse.portable_kernels():
        assert "switched off by portable_kernels()" in triton_sparse.hopper_decline(query)
    assert "needs CUDA" in triton_sparse.hopper_decline(query)  # the switch ends with the block


def test_info_line_names_the_hopper_kernels(monkeypatch):
    """`python -m megatron_dsa info` says which forward and backward serve dsv4 calls on the current GPU."""
    pytest.importorskip("triton")
    monkeypatch.setattr(triton_sparse, "triton_decline_reason", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (8, 0))
    assert triton_sparse.describe_hopper_kernels().endswith(
        "the portable kernel (the Hopper kernel needs a Hopper GPU (sm_90), got sm_80)")
    if triton_sparse._gluon_problem() is None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
        assert triton_sparse.describe_hopper_kernels().endswith("the Hopper kernel (Gluon)")


def test_hopper_kernels_need_a_triton_with_gluon(monkeypatch):
    pytest.importorskip("triton")

    class OldTriton:
        __version__ = "3.5.1"

    monkeypatch.setattr(triton_sparse.probes, "load", lambda module: OldTriton)
    triton_sparse._gluon_problem.cache_clear()
    try:
        assert "triton >= 3.6" in triton_sparse.hopper_shape_decline((9, 0), torch.bfloat16, 64, 512)
    finally:
        triton_sparse._gluon_problem.cache_clear()


HOPPER_SHARED_MEMORY = 232448  # bytes per block on sm_90
BF16, FP32 = "*bf16", "*fp32"
POINTERS = dict(q_ptr=BF16, kv_ptr=BF16, idx_ptr="*i32", sink_ptr=FP32, out_ptr=BF16, lse_ptr=FP32)
HOPPER_SIGNATURES = {
    "forward": dict(POINTERS, qk_scale="fp32", M="i32", K="i32", H="constexpr", D="constexpr"),
    "backward": dict(POINTERS, dout_ptr=BF16, dlse_ptr=FP32, dq_ptr=BF16, dkv_ptr=FP32, dsink_ptr=FP32,
                     scale="fp32", qk_scale="fp32", M="i32", K="i32", H="constexpr", D="constexpr",
                     HAS_DLSE="constexpr", num_warps="constexpr"),
}


def hopper_kernel(pass_name: str):
    if pass_name == "forward":
        from megatron_dsa.backends.triton_kernels._sparse_attention_hopper_forward_kernels import (
            sparse_attention_fwd_hopper_kernel,
        )
        return sparse_attention_fwd_hopper_kernel, 4, [dict(H=64, D=512), dict(H=128, D=512)]
    from megatron_dsa.backends.triton_kernels._sparse_attention_hopper_backward_kernels import (
        sparse_attention_bwd_hopper_kernel,
    )
    return sparse_attention_bwd_hopper_kernel, 8, [dict(H=64, D=512, HAS_DLSE=False, num_warps=8),
                                                   dict(H=128, D=512, HAS_DLSE=True, num_warps=8)]


@pytest.mark.parametrize("pass_name", ["forward", "backward"])
def test_hopper_kernels_compile_for_sm90_within_shared_memory_without_spills(pass_name, tmp_path):
    """The Gluon kernels compile for sm_90a on a machine without a GPU (triton bundles ptxas), within
    Hopper's shared memory per block, and without register spills: an edit that overflows the shared
    memory would otherwise fail only at launch, and one that lets the compiler hoist the forward's MMA
    descriptors out of its loop spills ~0.8 KB per thread and costs half its speed."""
    triton = pytest.importorskip("triton")
    problem = triton_sparse._gluon_problem()
    if problem is not None:
        pytest.skip(f"this triton cannot build the Hopper kernels: {problem}")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel, num_warps, variants = hopper_kernel(pass_name)
    signature = HOPPER_SIGNATURES[pass_name]
    # What a launch specialises on: 16-byte aligned pointers (torch allocations are).
    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    for constexprs in variants:
        source = GluonASTSource(fn=kernel, signature=signature, attrs=aligned, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
        assert "wgmma.mma_async" in compiled.asm["ptx"]
        assert 0 < compiled.metadata.shared <= HOPPER_SHARED_MEMORY, compiled.metadata.shared
        report = ptxas_report(compiled.asm["ptx"], tmp_path)
        assert "0 bytes spill stores" in report, report


# ---------------------------------------------------------------- GPU
def realistic_indices(rows: int, window: int, topk: int, ratio: int = 4, device: str = "cuda") -> tuple[Tensor, int]:
    """One causal sequence of `rows` tokens followed by its `rows // ratio` compressed entries in kv:
    per row a sliding window (ids < 0 before the start become -1) and `topk` random visible compressed
    entries (entry j is visible from row t when j < (t + 1) // ratio; -1 where fewer are visible).
    Returns `(indices [rows, window + topk] int32, kv rows)`."""
    entries = rows // ratio
    t = torch.arange(rows, device=device)
    win = t[:, None] - torch.arange(window - 1, -1, -1, device=device)[None, :]
    win = torch.where(win >= 0, win, -1)
    visible = torch.arange(entries, device=device)[None, :] < ((t + 1) // ratio)[:, None]
    scores = torch.rand(rows, entries, device=device).masked_fill(~visible, -1.0)
    top_scores, top = scores.topk(min(topk, entries), dim=1)
    top = torch.where(top_scores >= 0, top + rows, -1)
    if top.shape[1] < topk:
        top = torch.cat([top, top.new_full((rows, topk - top.shape[1]), -1)], 1)
    return torch.cat([win, top], 1).to(torch.int32), rows + entries


PASSES = (OpFamily.SPARSE_ATTENTION_FWD, OpFamily.SPARSE_ATTENTION_BWD)
HOPPER, PORTABLE = triton_sparse.HOPPER_VARIANT, triton_sparse.PORTABLE_VARIANT


def kernel_runs(op: OpFamily) -> Counter:
    """Runs of each Triton sparse-attention kernel of `op` so far, by variant (Gluon Hopper or portable)."""
    return Counter({variant: runs for (backend, family, variant), runs in variant_counts().items()
                    if backend == triton_sparse.BACKEND and family == op.value})


def cosine(a: Tensor, b: Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def relative_error(a: Tensor, b: Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rows, heads, dim, window, topk", [
    (torch.bfloat16, 4096, 64, 512, 128, 512),  # dsv4-flash: H = 64 local heads, K = 640
    (torch.bfloat16, 1024, 128, 512, 128, 512),  # 128 heads: two head blocks per row
    (torch.bfloat16, 512, 64, 576, 128, 512),  # D = 576: 512 + tail chunk of 64
    (torch.bfloat16, 256, 4, 32, 16, 16),  # tiny preset: 4 heads padded to 16
    (torch.float32, 512, 64, 512, 128, 512),  # fp32 end to end (IEEE dots)
], ids=["flash_bf16", "h128_bf16", "d576_bf16", "tiny_bf16", "flash_fp32"])
def test_gpu_matches_fp32_reference(dtype, rows, heads, dim, window, topk):
    torch.manual_seed(0)
    indices, kv_rows = realistic_indices(rows, window, topk)
    indices[:3] = -1  # a few rows with no valid index at all
    query = torch.randn(rows, heads, dim, device="cuda").to(dtype)
    kv = torch.randn(kv_rows, dim, device="cuda").to(dtype)
    sink = torch.randn(heads, device="cuda")
    grad_out = torch.randn(rows, heads, dim, device="cuda").to(dtype)
    grad_lse = torch.randn(rows, heads, device="cuda")
    scale = dim ** -0.5

    before = [kernel_runs(op) for op in PASSES]
    got = run_triton(query, kv, indices, sink, scale, grad_out, grad_lse)
    # The Hopper (Gluon) kernels serve bf16, 64-head blocks and D = 512 on sm_90; the rest is portable.
    hopper = (torch.cuda.get_device_capability()[0] == 9 and dtype == torch.bfloat16 and heads % 64 == 0
              and dim == 512)
    for op, earlier in zip(PASSES, before):
        assert kernel_runs(op) - earlier == {(HOPPER if hopper else PORTABLE): 1}, kernel_runs(op) - earlier
    expected = reference(query.float(), kv.float(), indices, sink, scale, grad_out.float(), grad_lse)
    assert got[0].dtype == dtype and got[3].dtype == dtype and got[4].dtype == torch.float32
    out, lse = got[:2]
    assert torch.equal(out[:3].float(), torch.zeros_like(out[:3].float()))
    assert torch.isinf(lse[:3]).all() and torch.isfinite(lse[3:]).all()
    # lse: fp32 scores from the same inputs in both; only the summation order differs.
    torch.testing.assert_close(lse, expected[1], atol=1e-3, rtol=1e-4)
    for name, a, b in zip(NAMES, got, expected):
        if name == "lse":
            continue  # checked above (it holds -inf on the empty rows)
        assert torch.isfinite(a).all(), name
        if dtype == torch.float32:  # IEEE fp32 dots: summation order only
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
            continue
        # bf16: the output is rounded to bf16 (2^-8 relative) and the probabilities / dS enter the
        # tensor-core dots as bf16 (2^-8 relative each, averaging out over the keys): cosine >= 0.9999
        # for the output, >= 0.999 for the gradients (which add more rounded terms), relative norm
        # error <= 1e-2 / 2e-2; the sink gradient sums fp32 per-row terms of the rounded output.
        out_like = name == "out"
        assert cosine(a, b) >= (0.9999 if out_like else 0.999), (name, cosine(a, b))
        assert relative_error(a, b) <= (1e-2 if out_like else 2e-2), (name, relative_error(a, b))


def hopper_case(pass_name: str, heads: int, window: int, topk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """`(query, kv, indices, sink, scale)` in bf16 for a Hopper-vs-portable comparison (1024 rows, D = 512):
    realistic indices with duplicates, ids past M and 5 rows without any valid id. Skips where the
    Hopper kernel of `pass_name` would not run."""
    decline = triton_sparse.hopper_shape_decline(torch.cuda.get_device_capability(), torch.bfloat16, heads, 512)
    if decline is not None:
        pytest.skip(f"the Hopper {pass_name} does not run here, so there is nothing to compare: it {decline}")
    torch.manual_seed(0)
    rows, dim = 1024, 512
    indices, kv_rows = realistic_indices(rows, window, topk)
    indices[:, -8:] = indices[:, :8]  # duplicates count as separate keys
    indices[::7, 1] = kv_rows + 3  # past M: ignored
    indices[:5] = -1
    query = torch.randn(rows, heads, dim, device="cuda").bfloat16()
    kv = torch.randn(kv_rows, dim, device="cuda").bfloat16()
    return query, kv, indices, torch.randn(heads, device="cuda"), dim ** -0.5


@pytest.mark.gpu
@pytest.mark.parametrize("heads, window, topk, with_lse_grad", [
    (64, 128, 512, False),  # dsv4-flash
    (128, 100, 300, True),  # two head blocks, K = 400 (not a multiple of the index block), LSE gradient
], ids=["flash", "h128_k400_dlse"])
def test_gpu_hopper_backward_matches_portable(heads, window, topk, with_lse_grad):
    """Metamorphic: the Hopper (Gluon) backward equals the portable Triton backward on the same inputs,
    including duplicate ids, -1 padding, ids past M and rows without any valid id."""
    query, kv, indices, sink, scale = hopper_case("backward", heads, window, topk)
    grad_out = torch.randn_like(query)
    grad_lse = torch.randn(query.shape[:2], device="cuda") if with_lse_grad else None
    out, lse = sparse_attention_forward(query, kv, indices, sink, scale)

    def backward() -> tuple[Tensor, ...]:
        return triton_sparse.sparse_attention_backward(query, kv, indices, sink, scale, out, lse, grad_out, grad_lse)

    before = kernel_runs(OpFamily.SPARSE_ATTENTION_BWD)
    hopper = backward()
    with triton_sparse.portable_kernels():
        portable = backward()
    assert kernel_runs(OpFamily.SPARSE_ATTENTION_BWD) - before == {HOPPER: 1, PORTABLE: 1}
    assert torch.equal(hopper[0][:5].float(), torch.zeros_like(hopper[0][:5].float()))  # rows without keys
    # Both round the same fp32 sums to bf16 (dq, dkv); only the fp32 summation order differs (the kv
    # gradient's atomics, in another order): cosine >= 0.99999 and relative norm error <= 2e-3 (a few bf16
    # roundings flip); the sink terms are the same fp32 formula per row.
    for name, a, b in zip(("grad_query", "grad_kv"), hopper[:2], portable[:2]):
        assert torch.isfinite(a).all(), name
        assert cosine(a, b) >= 0.99999, (name, cosine(a, b))
        assert relative_error(a, b) <= 2e-3, (name, relative_error(a, b))
    torch.testing.assert_close(hopper[2], portable[2], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, window, topk", [
    (64, 128, 512),  # dsv4-flash: 5 pairs of index blocks
    (128, 100, 300),  # two head blocks; K = 400: the last pair's second block is partly padding
    (64, 16, 40),  # K = 56: one index block, the pair's second block is all padding
], ids=["flash", "h128_k400", "k56"])
def test_gpu_hopper_forward_matches_portable(heads, window, topk):
    """Metamorphic: the Hopper (Gluon) forward equals the portable Triton forward on the same inputs,
    including duplicate ids, -1 padding, ids past M and rows without any valid id."""
    query, kv, indices, sink, scale = hopper_case("forward", heads, window, topk)
    before = kernel_runs(OpFamily.SPARSE_ATTENTION_FWD)
    out, lse = sparse_attention_forward(query, kv, indices, sink, scale)
    with triton_sparse.portable_kernels():
        portable_out, portable_lse = sparse_attention_forward(query, kv, indices, sink, scale)
    assert kernel_runs(OpFamily.SPARSE_ATTENTION_FWD) - before == {HOPPER: 1, PORTABLE: 1}
    assert torch.equal(out[:5].float(), torch.zeros_like(out[:5].float()))  # rows without keys
    assert torch.isinf(lse[:5]).all() and torch.isfinite(lse[5:]).all()
    # The LSE is an fp32 sum of fp32 exponentials in both, in another order: 1e-5 relative.
    torch.testing.assert_close(lse, portable_lse, atol=1e-4, rtol=1e-5)
    # Both round fp32 sums to a bf16 output; the probabilities enter the value MMA as bf16 in both, but the
    # Hopper kernel rounds half of them at a provisional maximum and rescales (2^-8 relative per rounding,
    # averaging out over the keys): cosine >= 0.99999, relative norm error <= 3e-3 (each side is ~2e-3
    # from the fp32 reference, mostly the output's own rounding).
    assert torch.isfinite(out).all()
    assert cosine(out, portable_out) >= 0.99999, cosine(out, portable_out)
    assert relative_error(out, portable_out) <= 3e-3, relative_error(out, portable_out)


@pytest.mark.gpu
def test_gpu_hopper_kernels_replay_in_a_cuda_graph():
    """Both Hopper kernels capture into one CUDA graph (no host sync, no allocation per launch), and a replay
    on new inputs equals eager calls: bit for bit for everything but the kv gradient, whose fp32 atomics
    may add in another order."""
    query, kv, indices, sink, scale = hopper_case("forward and backward", 64, 128, 512)
    grad_out = torch.randn_like(query)

    def step() -> tuple[Tensor, ...]:
        out, lse = sparse_attention_forward(query, kv, indices, sink, scale)
        return (out, lse, *triton_sparse.sparse_attention_backward(query, kv, indices, sink, scale, out, lse,
                                                                    grad_out, None))

    before = [kernel_runs(op) for op in PASSES]
    graph, captured = capture_graph(step, warmup=2)
    for op, earlier in zip(PASSES, before):  # two warm-up calls and the captured one
        assert kernel_runs(op) - earlier == {HOPPER: 3}, kernel_runs(op) - earlier
    for tensor in (query, kv, sink, grad_out):
        tensor.copy_(torch.randn_like(tensor))
    graph.replay()
    expected = step()
    for name, a, b in zip(NAMES, captured, expected):
        if name == "grad_kv":
            assert cosine(a, b) >= 0.99999 and relative_error(a, b) <= 2e-3, name
        else:
            assert torch.equal(a, b), name
