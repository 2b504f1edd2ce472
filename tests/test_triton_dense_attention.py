"""Dense attention of the `M` kind as Triton kernels (`backends/triton_kernels/dense_attention.py`).

The CPU cases of the kernels run in the Triton interpreter in a child process
(`interp_triton_dense_attention.py`; `triton_support.py` says why a child process). Here: what `auto` picks and
why, explicit requests that cannot run, bad inputs, and the sm_90a compile of every kernel at the dsv4 M dims
(no GPU needed). The GPU cases (bf16, against the reference) are in `test_backends_gpu.py`.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_dsa.backends import BackendUnavailableError, OpFamily, resolve
from megatron_dsa.backends.triton_kernels import _dense_attention_kernels as kernels
from megatron_dsa.backends.triton_kernels import dense_attention as triton_dense
from megatron_dsa.ops.layout import TokenLayout
from triton_support import compile_for_sm90, ptxas_report, run_interpreted, without_interpreter  # noqa: F401

CPU = torch.device("cpu")


def test_interpreter_cases():
    """The kernels against the reference op, block ops, non-finite isolation and an M layer (fp32, interpreter),
    in a child process."""
    run_interpreted("interp_triton_dense_attention.py")


def dense_call(**overrides):
    layout = TokenLayout.uniform(1, 8, CPU)
    return {**dict(device=CPU, dtype=torch.bfloat16, head_dim=576, v_head_dim=512, heads=8, groups=8, layout=layout,
                   lse_grad=False), **overrides}


def test_auto_on_cpu_runs_the_reference_and_an_explicit_triton_request_says_why(without_interpreter, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name, _ = resolve(OpFamily.DENSE_ATTENTION, "auto", **dense_call())
    assert name == "unfused"
    with pytest.raises(BackendUnavailableError, match="'triton' cannot run dense_attention: tensors on cpu"):
        resolve(OpFamily.DENSE_ATTENTION, "triton", **dense_call())


@pytest.mark.parametrize("overrides, reason", [
    (dict(head_dim=640), "head_dim 640 unsupported"),
    (dict(v_head_dim=1024), "v_head_dim 1024 unsupported"),
    (dict(groups=3), "3 kv groups do not divide 8 heads"),
    (dict(lse_grad=True), "lse carries no gradient"),
    (dict(dtype=torch.float64), "float64"),
    (dict(dtype=torch.float32), "float32 dense attention runs faster on the unfused reference"),
])
def test_the_triton_probe_names_what_it_cannot_take(overrides, reason, monkeypatch):
    """On a (pretended) GPU: the head dims past the kernels' registers, GQA that does not divide, an LSE
    gradient, float64, and (under `auto`) float32, which ran slower than the reference."""
    from megatron_dsa.backends import triton_kernels

    monkeypatch.setattr(triton_kernels.availability, "triton_decline_reason", lambda device, explicit=False: None)
    from megatron_dsa.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend, "triton_decline_reason", lambda device, explicit=False: None)
    reason_given = triton_backend.probe(OpFamily.DENSE_ATTENTION, dense_call(**overrides))
    assert reason_given is not None and reason in reason_given
    if overrides.get("dtype") == torch.float32:  # named, the kernels run it
        assert triton_backend.probe(OpFamily.DENSE_ATTENTION, dense_call(**overrides, explicit=True)) is None


@pytest.mark.parametrize("change, error, match", [
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "float64 runs on the unfused backend"),
    (lambda q, k, v: (q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1)), ValueError, "G dividing H"),
    (lambda q, k, v: (q, k, v[:, :, :0]), ValueError, "v head dim must be in"),
    (lambda q, k, v: (q[0], k, v), ValueError, "q must be 3-D"),
    (lambda q, k, v: (q, k[:5], v[:5]), ValueError, "one key row per query row"),
])
def test_bad_inputs_are_named(change, error, match):
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 8)
    with pytest.raises(error, match=match):
        triton_dense.dense_attention(*change(q, k, v), TokenLayout.uniform(1, 8, CPU), 0.3)


M_DIMS = dict(H=64, G=64, DQK=576, DV=512, CAUSAL=True, BLOCK_D=512, BLOCK_DT=64, BLOCK_V=512, BLOCK_VT=0,
              DOT_PRECISION="tf32")
POINTERS = {"starts_ptr": "*i32", "ends_ptr": "*i32", "lse_ptr": "*fp32", "delta_ptr": "*fp32"}


def _signature(kernel_name: str, constexprs: dict) -> dict:
    import inspect

    signature = {}
    for name in inspect.signature(getattr(kernels, kernel_name)).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*bf16")
        else:
            signature[name] = "fp32" if "scale" in name else "i32"
    return signature


# The key gradient's first candidate (two stages) does not fit at these dims: its second is the one that runs.
@pytest.mark.parametrize("kernel_name, candidate, extra", [
    ("dense_attention_fwd_kernel", triton_dense.FORWARD_CONFIGS[0], {}),
    ("dense_attention_bwd_dq_kernel", triton_dense.QUERY_GRAD_CONFIGS[0], {}),
    ("dense_attention_bwd_dkv_kernel", triton_dense.KEY_VALUE_GRAD_CONFIGS[1], dict(KEY_GRAD=True)),
    ("dense_attention_bwd_dkv_kernel", triton_dense.KEY_VALUE_GRAD_CONFIGS[0], dict(KEY_GRAD=False)),
], ids=["forward", "query_grad", "key_grad", "value_grad"])
def test_the_fastest_candidates_compile_for_hopper_within_its_shared_memory(kernel_name, candidate, extra, tmp_path):
    """The candidate measured fastest of each kernel (`dense_attention.FORWARD_CONFIGS` says where) compiles for
    sm_90a at the dsv4 M dims in bf16 and fits Hopper's 227 KB of shared memory (one that did not fit would never
    launch, and the autotuner would silently run a slower one), and its register spills stay at most 1 KB a thread
    (ptxas; 72-976 bytes when they were timed: a change that spilled much more would be slower)."""
    block_m, block_n, warps, stages = candidate
    constexprs = {**M_DIMS, **extra, "BLOCK_M": block_m, "BLOCK_N": block_n}
    compiled = compile_for_sm90(kernels, kernel_name, _signature(kernel_name, constexprs), constexprs, warps, stages)
    assert compiled.metadata.shared <= 227 * 1024
    spills = int(re.search(r"(\d+) bytes spill stores", ptxas_report(compiled.asm["ptx"], tmp_path)).group(1))
    assert spills <= 1024
