"""cuDNN's SM100 sparse forward on CPU: the glue, the probe, the one-time self-test that guards the adapter
(it has never run on an SM100 GPU here) and the forward under autograd with a backward, all against the
fake kernel (`FakeCudnnDSA.sparse_attention_forward_wrapper`: the kernel's contract with the reference
math, 16-bit inputs, a natural-log sink-free lse and +inf on rows without keys).

Tolerances: the fake runs the reference math on the padded 16-bit inputs, so the glue differs from the
reference only by float32 summation order over padded slots: out to 16-bit rounding (torch's defaults
for the dtype), lse within 1e-6. End-to-end autograd as in `test_backends_adapters`: cosine > 0.999,
relative error < 2e-2."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

import megatron_dsa.backends.cudnn as cudnn_backend
from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import BackendUnavailableError, OpFamily, probes, registry, resolve
from megatron_dsa.ops.sparse_attention import sparse_attention_forward
from test_backends_adapters import (  # noqa: F401 - `vendors` is a fixture
    LOGGER,
    assert_dispatched_sparse_autograd_matches_unfused,
    clear_probe_caches,
    on_gpu_generation,
    vendors,
    with_cudnn,
)
from vendor_fakes import FakeFlashMLA, fake_sparse_inputs, install

FWD = OpFamily.SPARSE_ATTENTION_FWD
CPU = torch.device("cpu")
CALL = dict(device=CPU, dtype=torch.bfloat16, heads=64, head_dim=512, topk=512, kv_rows=4096)
SM90_REASON = "cuDNN's sparse forward (built for SM100 only) needs SM10x, this GPU is SM90"


@pytest.fixture
def sm100(vendors: pytest.MonkeyPatch):
    """`vendors` on a (faked) SM100 GPU, with no self-test verdict kept from another test."""
    on_gpu_generation(vendors, (10, 0))
    probes.forget_self_tests()
    yield vendors
    probes.forget_self_tests()


def forward_calls(dsa) -> list[dict]:
    return [call for name, call in dsa.calls if name == "fwd"]


# ---------------------------------------------------------------- glue
@pytest.mark.parametrize("heads, width, dtype", [(3, 5, torch.bfloat16), (64, 64, torch.bfloat16),
                                                 (70, 130, torch.bfloat16), (128, 200, torch.float16)])
def test_cudnn_sparse_forward_glue_matches_the_reference(sm100, heads, width, dtype) -> None:
    dsa = with_cudnn(sm100, alignment=64)
    query, kv, indices, sink = fake_sparse_inputs(6, heads, 512, 11, width, dtype, seed=heads)
    sink = sink.to(dtype) if dtype == torch.float16 else sink  # a 16-bit sink parameter goes in as float32
    out, lse = cudnn_backend.sparse_attention_forward(query, kv, indices, sink, 0.05)
    out_ref, lse_ref = sparse_attention_forward(query, kv, indices, sink, 0.05)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-6)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()  # no keys: 0 and −inf, not the kernel's +inf
    seen, = forward_calls(dsa)
    assert seen["q"].shape[1] == (64 if heads <= 64 else 128) and seen["scale"] == 0.05  # plain scale
    assert seen["sink"].dtype == torch.float32 and torch.isneginf(seen["sink"][heads:]).all()
    ids = seen["ids"]
    assert ids.dtype == torch.int32 and ids.shape[1] == -(-width // 64) * 64 and (ids[:, width:] == -1).all()
    assert ids[0, 0] == -1 and (ids[1] == -1).all()  # the id ≥ M and the row without keys


def test_cudnn_sparse_forward_of_no_rows_and_no_slots(sm100) -> None:
    with_cudnn(sm100, alignment=64)
    query, kv, indices, sink = fake_sparse_inputs(3, 4, 512, 5, 2, torch.bfloat16, seed=0)
    out, lse = cudnn_backend.sparse_attention_forward(query, kv, indices[:, :0], sink, 0.05)
    assert (out == 0).all() and torch.isneginf(lse).all() and out.shape == query.shape
    out, lse = cudnn_backend.sparse_attention_forward(query[:0], kv, indices[:0], sink, 0.05)
    assert out.shape == (0, 4, 512) and lse.shape == (0, 4)


# ---------------------------------------------------------------- probe
@pytest.mark.parametrize("capability, change, expected", [
    ((9, 0), {}, SM90_REASON),
    ((8, 0), {}, "needs SM9x/SM10x, this GPU is SM80"),
    ((10, 0), dict(dtype=torch.float32), "dtype torch.float32 unsupported"),
    ((10, 0), dict(head_dim=576), "head dim 576 unsupported"),
    ((10, 0), dict(heads=256), "256 local heads unsupported"),
    ((10, 0), dict(kv_rows=2 ** 31), "kv rows exceed int32 ids"),
    ((10, 0), {}, None),
    ((10, 3), dict(heads=3, dtype=torch.float16, topk=5000), None),
])
def test_cudnn_sparse_forward_probe_table(sm100, capability, change, expected) -> None:
    with_cudnn(sm100, alignment=64)
    on_gpu_generation(sm100, capability)
    reason = cudnn_backend.CUDNN.decline_reason(FWD, {**CALL, **change})
    assert reason is None if expected is None else expected in reason, reason


def test_without_a_call_the_probe_answers_from_the_gpu_alone(sm100) -> None:
    """Layer construction and `info` ask without a call: nothing to self-test with, so nothing runs."""
    dsa = with_cudnn(sm100, alignment=64)
    assert cudnn_backend.CUDNN.decline_reason(FWD, {"explicit": False}) is None
    assert not forward_calls(dsa)
    on_gpu_generation(sm100, (9, 0))
    assert cudnn_backend.CUDNN.decline_reason(FWD, {"explicit": False}) == SM90_REASON
    assert ("cudnn", FWD.value, SM90_REASON) in [(b, op, r) for b, _, op, r in registry.availability_table()]


def test_explicit_cudnn_forward_on_sm90_raises_naming_the_reason(vendors) -> None:
    with_cudnn(vendors)
    on_gpu_generation(vendors, (9, 0))
    expected = re.escape(f"'cudnn' cannot run sparse_attention_fwd: {SM90_REASON}")
    with pytest.raises(BackendUnavailableError, match=expected):
        resolve(FWD, "cudnn", **CALL)
    config = HybridAttentionConfig.from_preset("tiny", attention_backend_overrides={"sparse_attention_fwd": "cudnn"})
    with pytest.raises(BackendUnavailableError, match=expected):
        HybridAttention(config, kind="C")  # at construction, before any forward


def test_auto_on_sm100_prefers_flashmla_then_cudnn(sm100) -> None:
    """Unmeasured on SM100: FlashMLA (bf16 only) stays first where installed; cuDNN's comes before the
    reference (and Triton, absent here)."""
    with_cudnn(sm100, alignment=64)
    assert resolve(FWD, **CALL)[0] == "cudnn"
    install(sm100, "flash_mla", FakeFlashMLA())
    clear_probe_caches()
    registry.forget_choices()
    assert resolve(FWD, **CALL)[0] == "flashmla"
    assert resolve(FWD, **{**CALL, "dtype": torch.float16})[0] == "cudnn"


# ---------------------------------------------------------------- self-test
def test_the_self_test_runs_once_per_call_class_on_a_problem_with_every_edge(sm100) -> None:
    dsa = with_cudnn(sm100, alignment=64)
    for _ in range(2):
        registry.forget_choices()
        assert resolve(FWD, **CALL)[0] == "cudnn"
    seen, = forward_calls(dsa)  # kept per (device, dtype, heads, head dim), also across kv rows and top-k
    assert resolve(FWD, **{**CALL, "kv_rows": 7, "topk": 3})[0] == "cudnn" and len(forward_calls(dsa)) == 1
    assert seen["scale"] == cudnn_backend.SELF_TEST_SCALE != 1 / math.sqrt(512)
    assert (seen["sink"] != 0).all() and seen["q"].shape == (4, 64, 512)
    # Repeated ids, −1, ids ≥ M (8) and below −1 (as the kernel gets them: −1), a row without keys.
    assert seen["ids"][:, :6].tolist() == [[3, 3, 5, -1, -1, 0], [-1] * 6, [7, 6, 5, 4, 3, 2], [1, -1, 1, -1, 1, 0]]
    assert resolve(FWD, **{**CALL, "heads": 8})[0] == "cudnn" and len(forward_calls(dsa)) == 2  # a new class


def test_a_forward_that_disagrees_with_the_reference_is_declined_and_auto_falls_back(sm100, caplog) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    dsa = with_cudnn(sm100, alignment=64)
    dsa.forward_lse_base2 = True
    for _ in range(3):
        registry.forget_choices()
        assert resolve(FWD, **CALL)[0] == "unfused"  # no FlashMLA or Triton here
    assert len(forward_calls(dsa)) == 1  # the verdict is kept
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1
    assert "'unfused'" in lines[0] and "cudnn: cuDNN's sparse forward failed its self-test against the " \
                                      "reference (max |Δout|" in lines[0] and "please report" in lines[0]
    with pytest.raises(BackendUnavailableError, match="'cudnn' cannot run sparse_attention_fwd: cuDNN's sparse "
                                                      "forward failed its self-test"):
        resolve(FWD, "cudnn", **CALL)


def test_a_forward_that_raises_is_declined_by_the_probe_not_raised(sm100) -> None:
    dsa = with_cudnn(sm100, alignment=64)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this GPU")

    dsa.sparse_attention_forward_wrapper = broken
    reason = cudnn_backend.CUDNN.decline_reason(FWD, CALL)
    assert reason == ("cuDNN's sparse forward failed its self-test (RuntimeError: no kernel image for this "
                      "GPU); please report")


def test_no_self_test_while_a_cuda_graph_is_captured(sm100) -> None:
    dsa = with_cudnn(sm100, alignment=64)
    sm100.setattr(probes, "capturing", lambda device: True)
    assert "while a CUDA graph is captured" in cudnn_backend.CUDNN.decline_reason(FWD, CALL)
    assert not forward_calls(dsa)
    sm100.setattr(probes, "capturing", lambda device: False)
    assert cudnn_backend.CUDNN.decline_reason(FWD, CALL) is None  # that decline was not kept
    assert len(forward_calls(dsa)) == 1


def test_a_verdict_kept_before_a_capture_answers_inside_it(sm100) -> None:
    """The warm-up step's self-test serves the capture (a layout in the call description keeps the
    dispatcher from remembering its choice, so the probe is asked again while capturing)."""
    dsa = with_cudnn(sm100, alignment=64)
    assert cudnn_backend.CUDNN.decline_reason(FWD, CALL) is None
    sm100.setattr(probes, "capturing", lambda device: True)
    assert cudnn_backend.CUDNN.decline_reason(FWD, CALL) is None
    assert len(forward_calls(dsa)) == 1  # the self-test ran once, before the capture


# ---------------------------------------------------------------- autograd composition
@pytest.mark.parametrize("use_lse", [False, True])
def test_cudnn_forward_with_dispatched_backward_equals_unfused_autograd(sm100, use_lse) -> None:
    """The forward's lse goes to the backward as is: with the (fake) cuDNN backward, or the reference one
    when the lse carries a gradient, the gradients match the unfused autograd."""
    with_cudnn(sm100, alignment=64)
    expected_bwd = "unfused" if use_lse else "cudnn"  # cuDNN's backward has no lse-gradient input
    assert_dispatched_sparse_autograd_matches_unfused(
        {"sparse_attention_fwd": "cudnn", "sparse_attention_bwd": "auto"}, use_lse,
        {("cudnn", "sparse_attention_fwd"): 1, (expected_bwd, "sparse_attention_bwd"): 1})
