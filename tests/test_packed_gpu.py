"""Packed (THD) input on a CUDA GPU: no host syncs, CUDA-graph replay with changed boundaries, and
bf16 accuracy against the float32 CPU result (bug class A5.5, docs/math.md §11).

Skipped without a GPU (the `gpu` marker, see conftest.py).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from megatron_dsa.layers.cuda_graphs import capture_graph
from test_packed_support import (
    Packed, assert_filler_rows_zero, make_layer, pack, random_segments, run_layer,
)

pytestmark = pytest.mark.gpu

VARIANTS = {
    "W": dict(kind="W"),
    "C-sparse-mean": dict(kind="C", dsa_indexer_use_sparse_loss=True, calculate_per_token_loss=False),
    "C-dense-per_token": dict(kind="C", dsa_indexer_use_sparse_loss=False, calculate_per_token_loss=True),
    "H": dict(kind="H"),
    "M": dict(kind="M"),
}


def cuda_layer(variant: str, dtype: torch.dtype = torch.float32, **overrides):
    options = dict(VARIANTS[variant], **overrides)
    return make_layer(options.pop("kind"), dtype=torch.float32, **options).to("cuda", dtype)


def cuda_pack(lengths, pads, tail, width, dtype=torch.float32, max_seqlen="exact") -> tuple[Packed, list]:
    """Segments, their packing and output grads, all on the GPU (cu_seqlens included)."""
    segments = random_segments(lengths, width, dtype, torch.device("cuda"))
    grads = random_segments(lengths, width, dtype, torch.device("cuda"))
    return pack(segments, pads, tail, max_seqlen=max_seqlen), grads


@pytest.fixture
def no_tf32():
    """Exact float32 matmuls, so graph-vs-eager differences are reduction order only."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


# ------------------------------------------------------------------------------ (a) no host sync
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_forward_backward_has_no_host_sync(variant):
    """cu_seqlens on the GPU and max_seqlen_q given: forward + backward never synchronise with the
    host (`set_sync_debug_mode("error")` raises on any synchronising CUDA call it detects; a control
    call that must sync proves the mode is live)."""
    layer = cuda_layer(variant)
    packed, grads = cuda_pack([37, 0, 5, 66, 3], [3, 2, 0, 1, 0], tail=9,
                              width=layer.config.hidden_size)
    assert packed.params.cu_seqlens_q.is_cuda and packed.params.max_seqlen_q is not None
    grad_out = packed.like(grads).unsqueeze(1)  # built before the checked region (H2D copies)
    hidden = packed.hidden.detach().requires_grad_()

    def forward_backward():
        out, _ = layer(hidden, packed_seq_params=packed.params)
        out.backward(grad_out)
        return out

    forward_backward()  # warm-up: lazy CUDA / cuBLAS initialisation is not the layer's doing
    torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)
    hidden.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = forward_backward()
        # Control: the check does catch a sync. Without max_seqlen_q the layer reads the longest
        # segment back from the device, which must raise here.
        unbounded = dataclasses.replace(packed.params, max_seqlen_q=None)
        with pytest.raises(RuntimeError, match="synchroniz"):
            layer(hidden.detach(), packed_seq_params=unbounded)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(hidden.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


# ------------------------------------------------------------------------------ (b) CUDA graph
# Two layouts of the same capacity T = 100 and segment count, but different boundaries.
GRAPH_LAYOUTS = {
    "first": dict(lengths=[30, 0, 17, 41], pads=[2, 1, 0, 3], tail=6),
    "second": dict(lengths=[5, 44, 1, 29], pads=[0, 3, 2, 4], tail=12),
}
GRAPH_MAX_SEQLEN = 64  # a fixed host bound, valid for both layouts


@pytest.mark.parametrize("variant", ["W", "C-sparse-mean", "C-dense-per_token", "H", "M"])
def test_cuda_graph_replay_with_changed_boundaries_matches_eager(variant, no_tf32):
    """Capture one packed forward + backward (static hidden / cu_seqlens / grad buffers, warm-up
    on a side stream, as the PyTorch CUDA-graph docs describe), then replay it after copying in
    inputs with *different* segment boundaries of the same total size: output, input grad, param
    grads and indexer loss equal an eager run of those inputs.

    Tolerance: float32 without TF32 runs the same kernels on the same values, so the forward is
    bitwise equal (as measured on an H100); the sparse attention backward accumulates dK/V with
    `index_add_` (atomics) in no fixed order, so grads differ by float32 reduction-order round-off
    (measured ≤ 4e-7 of the largest entry). rtol 1e-5 with atol 1e-5·max|eager| is well above that
    and far below what stale boundaries, a stale layout or a replayed host value would produce.
    """
    layer = cuda_layer(variant)
    width = layer.config.hidden_size
    names = [name for name, _ in layer.named_parameters()]
    params = list(layer.parameters())
    layouts = {}
    for key, layout in GRAPH_LAYOUTS.items():
        packed, grads = cuda_pack(layout["lengths"], layout["pads"], layout["tail"], width,
                                  max_seqlen=GRAPH_MAX_SEQLEN)
        layouts[key] = (packed, packed.like(grads).unsqueeze(1))
    rows = {packed.num_rows for packed, _ in layouts.values()}
    assert len(rows) == 1, "both layouts must have the same capacity"

    first, first_grad = layouts["first"]
    static_hidden = first.hidden.detach().clone().requires_grad_()
    static_grad = first_grad.clone()
    static_params = copy.copy(first.params)
    static_params.cu_seqlens_q = first.params.cu_seqlens_q.clone()
    static_params.cu_seqlens_q_padded = first.params.cu_seqlens_q_padded.clone()

    def load(packed: Packed, grad_out: torch.Tensor) -> None:
        with torch.no_grad():
            static_hidden.copy_(packed.hidden)
            static_grad.copy_(grad_out)
            static_params.cu_seqlens_q.copy_(packed.params.cu_seqlens_q)
            static_params.cu_seqlens_q_padded.copy_(packed.params.cu_seqlens_q_padded)

    def step():
        out, _ = layer(static_hidden, packed_seq_params=static_params)
        grads = torch.autograd.grad(out, [static_hidden, *params], static_grad, allow_unused=True)
        return out, grads, layer.last_indexer_loss

    def snapshot(result):
        out, grads, loss = result
        grads = [torch.zeros_like(p) if g is None else g.clone() for g, p in
                 zip(grads, [static_hidden, *params])]
        return out.detach().clone(), grads, None if loss is None else loss.clone()

    graph, static_result = capture_graph(step)

    for key in ("second", "first", "second"):
        packed, grad_out = layouts[key]
        load(packed, grad_out)
        graph.replay()
        torch.cuda.synchronize()
        replayed = snapshot(static_result)
        eager = snapshot(step())
        out, grads, loss = replayed
        assert torch.isfinite(out).all()
        filler = packed.filler
        assert torch.equal(out[filler], torch.zeros_like(out[filler])), f"{key}: filler rows"
        assert torch.equal(grads[0][filler], torch.zeros_like(grads[0][filler]))
        assert_close_f32(out, eager[0], f"{key}: output")
        for name, got, want in zip(["hidden", *names], grads, eager[1]):
            assert_close_f32(got, want, f"{key}: grad of {name}")
        if loss is not None:
            assert_close_f32(loss, eager[2], f"{key}: indexer loss")
    del graph


def assert_close_f32(actual, expected, what):
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * max(scale, 1e-12),
                               msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------ (c) bf16 accuracy
# Tolerances for bf16 (GPU) vs float32 (CPU) with the *same* bf16-rounded weights and inputs, so
# the difference is bf16 arithmetic alone: 8-bit mantissa, unit round-off 2^-9 ≈ 2e-3 per rounding.
# The layer chains about ten rounded steps (projections, norms, RoPE, attention, grouped and final
# projections; the same again backwards), so a relative L2 error of a few 1e-3 is expected (an H100
# gave 4e-3 to 7.5e-3 for every kind). We allow 2.5e-2, the bf16 tier of bug_classes T3 (TE's CP
# tolerance), and cosine > 0.999 (≈ 2.6°): both are 3x to 30x above the arithmetic noise and far
# below what a wrong segment boundary, row shift, lost padding mask or scale error produces.
# Top-k truncation is not arithmetic: bf16 rounding of the indexer scores legitimately flips a
# near-tied choice (1–2 rows of 124 here), which moves those rows' outputs by O(1) and their
# inputs' grads with them. So the C layers are compared with a top-k that keeps every visible
# entry, and truncation gets its own row-wise check.
BF16_COSINE, BF16_RELATIVE = 0.999, 2.5e-2
NO_TRUNCATION = dict(dsa_indexer_topk=64)  # >= the 17 entries of the longest (70-token) segment
BF16_LAYOUT = dict(lengths=[45, 0, 7, 70, 2], pads=[3, 1, 0, 2, 0], tail=11)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    assert torch.isfinite(got).all(), what
    assert cosine(got, want) > BF16_COSINE, f"{what}: cosine {cosine(got, want)}"
    assert relative_error(got, want) < BF16_RELATIVE, f"{what}: rel err {relative_error(got, want)}"


def bf16_and_fp32_runs(variant: str, **overrides):
    """The packed run of a bf16 GPU layer and of its float32 CPU copy on the same inputs."""
    layer = cuda_layer(variant, dtype=torch.bfloat16, **overrides)
    assert layer.linear_proj.weight.dtype == torch.bfloat16
    if hasattr(layer, "core_attention"):
        assert layer.core_attention.attn_sink.dtype == torch.float32  # kept high precision
    reference = cpu_float32_copy(layer, variant, **overrides)
    packed, grads = cuda_pack(**BF16_LAYOUT, width=layer.config.hidden_size, dtype=torch.bfloat16)
    grad_out = packed.like(grads).unsqueeze(1)
    run = run_layer(layer, packed.hidden, grad_out, packed.params)
    cpu_params = dataclasses.replace(packed.params, cu_seqlens_q=packed.params.cu_seqlens_q.cpu(),
                                     cu_seqlens_q_padded=packed.params.cu_seqlens_q_padded.cpu())
    ref = run_layer(reference, packed.hidden.cpu().float(), grad_out.cpu().float(), cpu_params)
    assert_filler_rows_zero(packed, run)
    return packed, run, ref


@pytest.mark.parametrize("variant", ["W", "C-sparse-mean", "C-dense-per_token", "H", "M"])
def test_bf16_packed_matches_fp32_cpu(variant):
    """bf16 on the GPU vs float32 on the CPU, packed with padding and a NaN tail: outputs and input
    grads of the real rows within the bf16 tolerances above; padding / tail rows exactly zero."""
    overrides = NO_TRUNCATION if VARIANTS[variant]["kind"] == "C" else {}
    packed, run, ref = bf16_and_fp32_runs(variant, **overrides)
    real = ~packed.filler.cpu()
    assert_bf16_close(run.out.cpu()[real], ref.out[real], "output")
    assert_bf16_close(run.grad_in.cpu()[real], ref.grad_in[real], "input grad")
    if run.compressed is not None:  # with no truncation the selected sets must agree exactly
        assert torch.equal(run.compressed.cpu()[real].sort(1).values, ref.compressed[real].sort(1).values)


@pytest.mark.parametrize("variant", ["C-sparse-mean", "C-dense-per_token"])
def test_bf16_packed_topk_truncation_matches_fp32_cpu(variant):
    """With a truncating top-k (3): the bf16 selection equals the float32 one on at least 90% of
    the real rows (only near-ties may flip), and those rows' outputs (which depend on no other row's
    selection) are within the bf16 tolerances."""
    packed, run, ref = bf16_and_fp32_runs(variant)
    real = ~packed.filler.cpu()
    same = (run.compressed.cpu().sort(1).values == ref.compressed.sort(1).values).all(1) & real
    assert same.sum() >= 0.9 * real.sum(), f"{int((real & ~same).sum())} rows chose differently"
    assert_bf16_close(run.out.cpu()[same], ref.out[same], "output of rows with the same top-k")


def cpu_float32_copy(layer, variant: str, **overrides):
    """The same layer in float32 on the CPU, holding the bf16-rounded weights exactly."""
    options = dict(VARIANTS[variant], **overrides)
    reference = make_layer(options.pop("kind"), dtype=torch.float32, **options)
    reference.load_state_dict(layer.state_dict())  # copy_ upcasts the bf16 values exactly
    for (name, mine), theirs in zip(reference.named_parameters(), layer.parameters()):
        assert torch.equal(mine, theirs.detach().cpu().float()), name
    return reference
