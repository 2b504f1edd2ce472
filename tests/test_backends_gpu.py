"""Real vendor kernels vs the unfused reference on a GPU, in bf16 (run by hand on an H100/H200:
`pytest -m gpu tests/test_backends_gpu.py`). Each test skips, naming the package, when its vendor
package is not installed. Call counters prove the fused kernel ran (bug class A10.4).

Tolerances. Both sides see the same bf16 inputs; the reference computes in float32, the kernels keep
bf16 operands for their matmuls (P and dS rounded to bf16, ~3 significant digits) with float32
accumulation, so the differences are bf16 rounding noise summed over hundreds of keys: forward
outputs cosine ≥ 0.999 and relative error ≤ 2e-2 (spec tier T4: 1 − cos < 2e-3); gradients cosine ≥
0.995 and relative error ≤ 5e-2 (T4 backward: 1 − cos < 2e-2). A wrong softmax scale (applied twice
or not at all, bug class A2.1), a missing sink or a base-2 LSE moves the cosine well below 0.99 or
the LSE by ≥ 30 %; integer outputs (top-k) must be equal.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import (BackendUnavailableError, OpFamily, call_counts, dispatch, probes,
                                   reset_call_counts, resolve)
from megatron_dsa.backends.flash_attn import FLASH_ATTENTION_3, ShapeClass
from megatron_dsa.backends.dispatched_sparse_attention import sparse_attention
from megatron_dsa.layers.cuda_graphs import capture_graph
from megatron_dsa.ops.dense_attention import causal_attention
from megatron_dsa.ops.indexer import indexer_scores as reference_indexer_scores
from megatron_dsa.ops.indexer_loss import indexer_kl as reference_indexer_kl
from megatron_dsa.ops.indexer_loss import indexer_kl_backward as reference_indexer_kl_backward
from megatron_dsa.ops.indices import topk_columns, visible_compressed_entries
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.sparse_attention import sparse_attention as reference_sparse_attention
from megatron_dsa.ops.sparse_attention import full_normaliser
from distributed import cosine, relative_error
from saved_tensors import SavedTensorGuard

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SCALE = 0.05  # not the kernels' default 512^-1/2 = 0.0442: a kernel ignoring our scale fails


def require(module: str, why: str) -> None:
    problem = probes.import_problem(module, "")
    if problem is not None:
        pytest.skip(f"{why}: {problem}")


def assert_close_bf16(name: str, actual: torch.Tensor, expected: torch.Tensor, grad: bool) -> None:
    actual, expected = actual.detach().float(), expected.detach().float()
    assert torch.isfinite(actual).all(), f"{name}: not finite"
    cos_bound, rel_bound = (0.995, 5e-2) if grad else (0.999, 2e-2)
    assert cosine(actual, expected) >= cos_bound, f"{name}: cosine {cosine(actual, expected)}"
    assert relative_error(actual, expected) <= rel_bound, f"{name}: rel err {relative_error(actual, expected)}"


def sparse_problem(rows: int, heads: int, width: int, seed: int = 0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    kv_rows = rows + rows // 4
    query = torch.randn(rows, heads, 512, device=CUDA, generator=gen).bfloat16()
    kv = torch.randn(kv_rows, 512, device=CUDA, generator=gen).bfloat16()
    indices = torch.randint(0, kv_rows, (rows, width), device=CUDA, generator=gen)
    indices[:, -7:] = -1  # padding slots
    indices[3, :] = -1  # a row without keys
    indices[5, 0] = kv_rows + 3  # out of range: invalid
    sink = torch.linspace(-4, 4, heads, device=CUDA)
    return query, kv, indices, sink


def run_sparse(fn, query, kv, indices, sink):
    query, kv, sink = (t.detach().clone().requires_grad_() for t in (query, kv, sink))
    out, lse = fn(query, kv, indices, sink)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    (out.float() * torch.randn(out.shape, device=CUDA, generator=gen)).sum().backward()
    return out, lse, query.grad, kv.grad, sink.grad


@pytest.mark.parametrize("heads, width", [(64, 640), (16, 200), (128, 512)])
def test_flashmla_forward_and_cudnn_backward_match_unfused(heads, width) -> None:
    require("flash_mla", "FlashMLA not built here")
    require("cudnn", "nvidia-cudnn-frontend not installed")
    problem = sparse_problem(2048, heads, width)
    config = HybridAttentionConfig.from_preset("tiny", attention_backend_overrides={
        "sparse_attention_fwd": "flashmla", "sparse_attention_bwd": "cudnn"})
    reset_call_counts()
    fused = run_sparse(lambda q, kv, i, s: sparse_attention(q, kv, i, s, SCALE, config), *problem)
    assert call_counts() == {("flashmla", "sparse_attention_fwd"): 1, ("cudnn", "sparse_attention_bwd"): 1}
    reference = run_sparse(lambda q, kv, i, s: reference_sparse_attention(q, kv, i, s, SCALE), *problem)
    assert torch.isneginf(fused[1][3]).all() and (fused[0][3] == 0).all()  # the empty row
    finite = torch.isfinite(reference[1])
    assert_close_bf16("out", fused[0], reference[0], grad=False)
    assert_close_bf16("lse", fused[1][finite], reference[1][finite], grad=False)
    for name, a, b in zip(("dq", "dkv", "dsink"), fused[2:], reference[2:]):
        assert_close_bf16(name, a, b, grad=True)


def test_cudnn_backward_alone_matches_unfused_backward() -> None:
    """The reference forward feeds the cuDNN backward: isolates the backward's scale and LSE use."""
    require("cudnn", "nvidia-cudnn-frontend not installed")
    problem = sparse_problem(1024, 64, 640, seed=1)
    config = HybridAttentionConfig.from_preset("tiny", attention_backend_overrides={
        "sparse_attention_fwd": "unfused", "sparse_attention_bwd": "cudnn"})
    reset_call_counts()
    fused = run_sparse(lambda q, kv, i, s: sparse_attention(q, kv, i, s, SCALE, config), *problem)
    assert call_counts()[("cudnn", "sparse_attention_bwd")] == 1
    reference = run_sparse(lambda q, kv, i, s: reference_sparse_attention(q, kv, i, s, SCALE), *problem)
    for name, a, b in zip(("dq", "dkv", "dsink"), fused[2:], reference[2:]):
        assert_close_bf16(name, a, b, grad=True)


def test_cudnn_topk_matches_topk_columns_with_ties_and_short_rows() -> None:
    require("cudnn", "nvidia-cudnn-frontend not installed")
    rows, cols = 1024, 4096
    gen = torch.Generator(device=CUDA).manual_seed(2)
    scores = torch.relu(torch.randn(rows, cols, device=CUDA, generator=gen)).round()  # many exact ties, zeros
    scores[0, :100] = torch.arange(100, 0, -1, device=CUDA).float()  # 100 winners, the rest 0 (A4.3)
    scores[1] = 1.0  # all equal
    visible = (torch.arange(cols, device=CUDA) < torch.randint(0, cols, (rows, 1), device=CUDA, generator=gen))
    visible[2] = False  # nothing visible
    visible[4, 300:] = False  # fewer visible than k
    _, topk = resolve(OpFamily.TOPK, "cudnn", device=CUDA, dtype=scores.dtype, topk=512)
    # The `counts` hint as a layer gives it (`VisibleEntries.prefix_counts`): each row's visible prefix, with the
    # scores −inf past it as the indexer writes them; the kernel then scans only the prefix.
    counts, masked = visible.sum(1), torch.where(visible, scores, float("-inf"))
    for k in (512, 2048):
        expected = topk_columns(scores, visible, k)
        for _ in range(3):  # the same result every run
            assert torch.equal(topk(scores, visible, k), expected), k
        assert torch.equal(topk(masked, visible, k, None, counts), expected), k


def test_cudnn_indexer_scores_match_unfused_on_uniform_row_chunks() -> None:
    """cuDNN's dense indexer forward (THD segments, causal offsets) against the reference scores of the
    visible entries at the dsv4-flash indexer dims (64 heads × 128, ratio 4): two 2048-token
    sequences, whole and as a chunk starting mid-sequence; then cuDNN's top-k of those scores with the
    uniform structure (visible prefixes as scan lengths) against `topk_columns`. Tolerance: both sum
    float32 products of the same bf16 inputs; 5e-3 relative leaves room for one bf16 rounding of an
    intermediate in the kernel. The −inf pattern (the ratio-causal rule) must match exactly.
    """
    require("cudnn", "nvidia-cudnn-frontend not installed")
    gen = torch.Generator(device=CUDA).manual_seed(8)
    layout = TokenLayout.uniform(2, 2048, CUDA)
    entries = visible_compressed_entries(layout.compressed(4))
    q = torch.randn(layout.num_rows, 64, 128, device=CUDA, generator=gen).bfloat16()
    k = torch.randn(entries.table.numel(), 128, device=CUDA, generator=gen).bfloat16()
    weights = (torch.randn(layout.num_rows, 64, device=CUDA, generator=gen) * 64 ** -0.5).bfloat16()
    scale = 128 ** -0.5
    for chunk in (slice(0, 4096), slice(1000, 3001)):
        candidates, visible = entries.rows(chunk), entries.uniform_rows(chunk)
        kernel = dispatch(OpFamily.INDEXER_SCORES, "cudnn", device=CUDA, dtype=torch.bfloat16, heads=64,
                          head_dim=128, visible=True)
        reset_call_counts()
        got = kernel(q[chunk], k, weights[chunk], candidates, scale, visible)
        assert call_counts() == {("cudnn", "indexer_scores"): 1}
        expected = reference_indexer_scores(q[chunk], k, weights[chunk], candidates, scale)
        assert torch.equal(torch.isneginf(got), candidates < 0), chunk
        finite = candidates >= 0
        assert relative_error(got[finite], expected[finite]) <= 5e-3, chunk
        # The layer's next step: top-k over these scores with the same structure hint.
        _, topk = resolve(OpFamily.TOPK, "cudnn", device=CUDA, dtype=got.dtype, topk=512)
        assert torch.equal(topk(got, finite, 512, visible), topk_columns(got, finite, 512)), chunk


def test_cudnn_indexer_scores_match_unfused_on_cp_row_segments() -> None:
    """The same kernel on a CP-2 rank's extended rows of an SBHD batch (two 4096-token sequences, zigzag, halo
    127, ratio 4: each rank holds two pieces of each sequence, with their halos), through the dispatched op with
    the rows' `SegmentedVisibleRows` (keys gathered per segment in sequence order): whole and as a chunk that
    cuts segments, against the reference scores of the candidates. Same tolerance and −inf rule as above."""
    require("cudnn", "nvidia-cudnn-frontend not installed")
    from megatron_dsa.layers.context_parallel import ContextParallelRows
    from megatron_dsa.parallel.context import ContextParallelPlan

    gen = torch.Generator(device=CUDA).manual_seed(9)
    for rank in (0, 1):
        rows = ContextParallelRows(ContextParallelPlan.build((4096, 4096), 2, "zigzag"), rank, None, 127, CUDA,
                                   batch=2)
        entries = rows.visible_entries(4)
        n = rows.layout.num_rows
        q = torch.randn(n, 64, 128, device=CUDA, generator=gen).bfloat16()
        k = torch.randn(2 * len(rows.pieces) * rows.slots_per_piece(4), 128, device=CUDA, generator=gen).bfloat16()
        weights = (torch.randn(n, 64, device=CUDA, generator=gen) * 64 ** -0.5).bfloat16()
        for chunk in (slice(0, n), slice(700, 3333)):
            candidates, visible = entries.rows(chunk), entries.segmented_rows(chunk)
            kernel = dispatch(OpFamily.INDEXER_SCORES, "cudnn", device=CUDA, dtype=torch.bfloat16, heads=64,
                              head_dim=128, visible=True)
            reset_call_counts()
            got = kernel(q[chunk], k, weights[chunk], candidates, 128 ** -0.5, visible)
            assert call_counts() == {("cudnn", "indexer_scores"): 1}
            expected = reference_indexer_scores(q[chunk], k, weights[chunk], candidates, 128 ** -0.5)
            assert torch.equal(torch.isneginf(got), candidates < 0), (rank, chunk)
            finite = candidates >= 0
            assert relative_error(got[finite], expected[finite]) <= 5e-3, (rank, chunk)


@pytest.mark.parametrize("backend", ["cudnn", "triton"])
def test_fused_indexer_kl_backward_matches_unfused(backend: str) -> None:
    """cuDNN's and Triton's fused indexer backward (KL gradient + scores backward) against the reference,
    at the dsv4-flash indexer dims (64 heads × 128, top-k 512) with −1 slots, an empty row and row weights."""
    require(backend, {"cudnn": "nvidia-cudnn-frontend not installed", "triton": "triton not installed"}[backend])
    gen = torch.Generator(device=CUDA).manual_seed(5)
    rows, heads, keys, width, scale = 2048, 64, 512, 512, 128 ** -0.5
    q = torch.randn(rows, heads, 128, device=CUDA, generator=gen).bfloat16()
    k = torch.randn(keys, 128, device=CUDA, generator=gen).bfloat16()
    weights = (torch.randn(rows, heads, device=CUDA, generator=gen) * heads ** -0.5).bfloat16()
    candidates = torch.randint(0, keys, (rows, width), device=CUDA, generator=gen)
    candidates[:, -100:] = -1
    candidates[7] = -1
    mass = torch.rand(rows, width, device=CUDA, generator=gen) * (candidates >= 0)
    target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    student = reference_indexer_scores(q, k, weights, candidates, scale)
    grad_rows = torch.full((rows,), 1e-3 / rows, device=CUDA)
    grad_rows[11] = 0.0
    reset_call_counts()
    kernel = dispatch(OpFamily.INDEXER_KL_BWD, backend, device=CUDA, dtype=torch.bfloat16, heads=heads,
                      head_dim=128, topk=width, dense=False)
    fused = kernel(q, k, weights, candidates, target, student, grad_rows, scale)
    assert call_counts() == {(backend, "indexer_kl_bwd"): 1}
    expected = reference_indexer_kl_backward(q, k, weights, candidates, target, student, grad_rows, scale)
    for name, a, b in zip(("dq", "dk", "dweights"), fused, expected):
        assert_close_bf16(name, a, b, grad=True)


@pytest.mark.parametrize("heads, width", [(64, 512), (128, 1024), (20, 200)])
def test_cudnn_teacher_matches_unfused_indexer_loss(heads, width) -> None:
    """cuDNN's sparse target kernel (+ our renormalisation and KL) against the unfused `indexer_kl` at the
    attention dims of dsv4-flash (64 heads, top-k 512) and dsv4-pro (128 heads: two head tiles, top-k
    1024), and a padded case (20 heads → 64, 200 slots → 256), with −1 slots, an id ≥ M, a row
    without candidates, and a row whose normaliser is raised by 40 so its mass sums to far below the
    kernel's ε = 1e-10 (the kernel alone would shrink that row's target to ~0).

    Tolerance: both sides take float32 dots of the same bf16 inputs (WGMMA with float32 accumulation
    vs a float32 einsum) and the same float32 normaliser; summation order and the kernel's `ex2.approx`
    give ~1e-5 relative on the target. Target and KL relative error ≤ 1e-3 keeps a wide margin, while
    a scale applied twice (bug class A2.1), a base-2 or sink-free LSE, or a padding head with mass
    moves them by tens of percent. Zeros (invalid slots, the empty row) must be exact."""
    require("cudnn", "nvidia-cudnn-frontend not installed")
    query, kv, candidates, sink = sparse_problem(2048, heads, width, seed=12)
    full_lse = full_normaliser(query, kv, candidates, sink, SCALE)
    full_lse[9] += 40.0
    gen = torch.Generator(device=CUDA).manual_seed(13)
    student = torch.randn(candidates.shape, device=CUDA, generator=gen).masked_fill(candidates < 0, float("-inf"))
    loss = dispatch(OpFamily.INDEXER_LOSS, "cudnn", device=CUDA, dtype=torch.bfloat16, heads=heads, head_dim=512,
                    topk=width, dense=False, tp_size=1)
    reset_call_counts()
    kl, target = loss(student, query, kv, candidates, full_lse, SCALE, return_target=True)
    assert call_counts() == {("cudnn", "indexer_loss"): 1}
    kl_ref, target_ref = reference_indexer_kl(student, query, kv, candidates, full_lse, SCALE, return_target=True)
    assert target.shape == target_ref.shape and target.dtype == target_ref.dtype
    invalid = (candidates < 0) | (candidates >= kv.shape[0])
    assert (target[invalid] == 0).all() and (target[3] == 0).all() and kl[3] == 0  # row 3: no candidates
    assert abs(float(target[9].sum()) - 1.0) < 1e-5  # the row below the kernel's ε
    assert cosine(target, target_ref) >= 0.99999 and relative_error(target, target_ref) <= 1e-3
    assert torch.isfinite(kl).all() and relative_error(kl, kl_ref) <= 1e-3


def test_c_layer_with_the_cudnn_teacher_matches_the_unfused_teacher() -> None:
    """A dsv4-flash C layer whose sparse indexer loss takes its teacher from cuDNN (everything else
    `auto`) against the same layer with the unfused teacher: the loss to 1e-3 relative (the teacher's
    float32 differences above), the indexer's gradients at cosine ≥ 0.99 (trained by the KL loss
    only, a difference of nearly equal probabilities whose bf16 error is amplified, as in the
    auto-vs-unfused layer test)."""
    require("cudnn", "nvidia-cudnn-frontend not installed")
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset("dsv4-flash", num_layers=1, layer_pattern="C")
    hidden = torch.randn(2048, 1, config.hidden_size, device=CUDA).bfloat16()
    results, state = {}, None
    for teacher in ("cudnn", "unfused"):
        layer = HybridAttention(config.replace(attention_backend_overrides={"indexer_loss": teacher}),
                                kind="C").to(CUDA, torch.bfloat16).train()
        state = layer.state_dict() if state is None else state
        layer.load_state_dict(state)
        reset_call_counts()
        out, _ = layer(hidden)
        out.float().square().sum().backward()
        grads = {name: p.grad for name, p in layer.named_parameters() if "indexer" in name and p.grad is not None}
        results[teacher] = (layer.last_indexer_loss, grads, call_counts())
    (loss, grads, counts), (loss_ref, grads_ref, counts_ref) = results["cudnn"], results["unfused"]
    assert counts[("cudnn", "indexer_loss")] == 1 and counts_ref[("unfused", "indexer_loss")] == 1
    assert relative_error(loss, loss_ref) <= 1e-3
    assert grads.keys() == grads_ref.keys() and grads
    for name in grads:
        assert cosine(grads[name], grads_ref[name]) >= 0.99, name


# ---------------------------------------------------------------- dense attention (M kind)
DENSE = [("flash_attn", "flash_attn.cute", "flash-attn-4 not installed"),
         ("cudnn", "torch", ""), ("torch_sdpa", "torch", ""), ("triton", "triton", "triton not installed")]


# Packed boundaries over 2048 rows. The tail case ends at 1400: rows 1400-2047 are a capacity tail, which
# runs the last segment past max_seqlen = 800. Tail rows are padding whose values the op leaves open there
# (the reference looks back at most max_seqlen rows, FlashAttention-4 to the segment start), so that case
# compares the real rows, with a loss on real rows only; real rows never see the tail's keys (causal).
PACKED_BOUNDARIES = {"packed": [0, 700, 1500, 2048], "packed_tail": [0, 700, 1400]}


@pytest.mark.parametrize("backend, module, why", DENSE)
@pytest.mark.parametrize("packed", [None, "packed", "packed_tail"])
@pytest.mark.parametrize("groups", [4, 16])  # GQA and MHA, MLA head dims 192/128
def test_dense_backends_match_unfused(backend, module, why, packed, groups) -> None:
    require(module, why)
    heads, seqlen, batch = 16, 1024, 2
    real_rows = 1400 if packed == "packed_tail" else 2048
    if packed:
        boundaries = torch.tensor(PACKED_BOUNDARIES[packed], dtype=torch.int32, device=CUDA)
        layout = TokenLayout.packed(boundaries, 2048, CUDA, max_seqlen=800)
    else:
        layout = TokenLayout.uniform(batch, seqlen, CUDA)
    call = dict(device=CUDA, dtype=torch.bfloat16, head_dim=192, v_head_dim=128, heads=heads, groups=groups,
                layout=layout, lse_grad=False)
    fa4_only = FLASH_ATTENTION_3.problem(ShapeClass.of_call(call)) is not None  # FA3 would serve GQA 192/128
    if backend == "flash_attn" and groups < heads and torch.cuda.get_device_capability()[0] == 9 and fa4_only:
        with pytest.raises(BackendUnavailableError, match="SM90 backward needs qk head dim == v head dim"):
            resolve(OpFamily.DENSE_ATTENTION, backend, **call)
        return  # declined up front (FA4 would assert in backward); auto takes the next backend
    if packed and backend in ("cudnn", "torch_sdpa"):  # batched kernels: whole sequences of one length
        with pytest.raises(BackendUnavailableError, match="packed/padded layouts unsupported"):
            resolve(OpFamily.DENSE_ATTENTION, backend, **call)
        return  # declined up front; auto takes FlashAttention or the reference for packed input
    _, attend = resolve(OpFamily.DENSE_ATTENTION, backend, **call)
    gen = torch.Generator(device=CUDA).manual_seed(3)
    inputs = [torch.randn(2048, h, d, device=CUDA, generator=gen).bfloat16()
              for h, d in ((heads, 192), (groups, 192), (groups, 128))]

    def run(fn):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out, lse = fn(q, k, v, layout, 0.07)
        out[:real_rows].float().square().sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        return out[:real_rows], lse[:real_rows], q.grad, k.grad, v.grad

    fused, reference = run(attend), run(causal_attention)
    assert_close_bf16("out", fused[0], reference[0], grad=False)
    assert_close_bf16("lse", fused[1], reference[1], grad=False)
    for label, a, b in zip(("dq", "dk", "dv"), fused[2:], reference[2:]):
        assert_close_bf16(label, a, b, grad=True)


def test_triton_dense_attention_at_dsv4_m_dims_matches_unfused() -> None:
    """The `M` kind's own dims (qk 576 / v 512: only our Triton kernels and the reference take them), packed
    with a capacity tail and GQA, and `auto` picks Triton for them (the counters)."""
    heads, groups, rows, real_rows = 16, 4, 1100, 1000
    layout = TokenLayout.packed(torch.tensor([0, 300, 301, 1000], device=CUDA), rows, CUDA, max_seqlen=699)
    reset_call_counts()
    attend = dispatch(OpFamily.DENSE_ATTENTION, "auto", device=CUDA, dtype=torch.bfloat16, head_dim=576,
                      v_head_dim=512, heads=heads, groups=groups, layout=layout, lse_grad=False)
    gen = torch.Generator(device=CUDA).manual_seed(5)
    inputs = [torch.randn(rows, h, d, device=CUDA, generator=gen).bfloat16()
              for h, d in ((heads, 576), (groups, 576), (groups, 512))]
    upstream = torch.randn(real_rows, heads, 512, device=CUDA, generator=gen)

    def run(fn):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out, lse = fn(q, k, v, layout, SCALE)
        (out[:real_rows].float() * upstream).sum().backward()
        return out[:real_rows], lse[:real_rows], q.grad, k.grad, v.grad

    fused = run(attend)
    assert call_counts()[("triton", "dense_attention")] == 1, call_counts()
    reference = run(causal_attention)
    assert_close_bf16("out", fused[0], reference[0], grad=False)
    assert_close_bf16("lse", fused[1], reference[1], grad=False)
    for label, a, b in zip(("dq", "dk", "dv"), fused[2:], reference[2:]):
        assert_close_bf16(label, a, b, grad=True)


@pytest.mark.parametrize("causal", [True, False], ids=["diagonal_block", "earlier_block"])
def test_triton_dense_blocks_match_unfused_blocks(causal) -> None:
    """The context-parallel ring's block ops at the M kind's dims: forward, and backward from a merged output
    and LSE (here: the block's own, scaled as a merge would leave them) against the reference block ops."""
    from megatron_dsa.ops.dense_attention import block_attention_backward, block_attention_forward

    heads, groups, n = 16, 16, 700
    m = n if causal else 900
    gen = torch.Generator(device=CUDA).manual_seed(9)
    q = torch.randn(n, heads, 576, device=CUDA, generator=gen).bfloat16()
    k = torch.randn(m, groups, 576, device=CUDA, generator=gen).bfloat16()
    v = torch.randn(m, groups, 512, device=CUDA, generator=gen).bfloat16()
    grad_out = torch.randn(n, heads, 512, device=CUDA, generator=gen)
    reset_call_counts()
    call = dict(device=CUDA, dtype=torch.bfloat16, head_dim=576, v_head_dim=512, heads=heads, groups=groups,
                lse_grad=False)
    out, lse = dispatch(OpFamily.DENSE_ATTENTION_BLOCK_FWD, "triton", **call)(q, k, v, SCALE, causal)
    out_ref, lse_ref = block_attention_forward(q, k, v, SCALE, causal)
    assert out.dtype == lse.dtype == torch.float32
    assert_close_bf16("block out", out, out_ref, grad=False)
    assert_close_bf16("block lse", lse, lse_ref, grad=False)
    merged_lse = lse_ref + 0.3  # as if other blocks held more of the softmax mass
    merged_out = out_ref * 0.7
    grads = dispatch(OpFamily.DENSE_ATTENTION_BLOCK_BWD, "triton", **call)(q, k, v, merged_out, merged_lse, grad_out,
                                                                          SCALE, causal)
    grads_ref = block_attention_backward(q, k, v, merged_out, merged_lse, grad_out, SCALE, causal)
    for label, a, b in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert a.dtype == torch.float32
        assert_close_bf16(f"block {label}", a, b, grad=True)
    counts = call_counts()
    assert counts[("triton", "dense_attention_block_fwd")] == counts[("triton", "dense_attention_block_bwd")] == 1


# ---------------------------------------------------------------- whole layer, auto vs unfused
def layer_run(config: HybridAttentionConfig, kind: str, state, hidden: torch.Tensor):
    layer = HybridAttention(config, kind=kind).to(CUDA, torch.bfloat16).train()
    if state is not None:
        layer.load_state_dict(state)
    x = hidden.clone().requires_grad_()
    reset_call_counts()
    out, _ = layer(x)
    gen = torch.Generator(device=CUDA).manual_seed(11)
    (out.float() * torch.randn(out.shape, device=CUDA, generator=gen)).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return layer.state_dict(), out, x.grad, grads, call_counts()


M_FUSABLE = dict(v_head_dim=128, qk_head_dim=128, qk_pos_emb_head_dim=64, kv_lora_rank=512)  # dense kernels take ≤ 256


@pytest.mark.parametrize("kind, overrides", [("W", {}), ("C", {}), ("H", {}), ("M", M_FUSABLE), ("M", {})],
                         ids=["W", "C", "H", "M_192_128", "M"])
def test_layer_auto_matches_unfused_at_dsv4_flash_dims(kind, overrides) -> None:
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset("dsv4-flash", num_layers=1, layer_pattern=kind, **overrides)
    hidden = torch.randn(2048, 1, config.hidden_size, device=CUDA).bfloat16()
    state, out, grad_x, grads, fused_counts = layer_run(config, kind, None, hidden)
    _, out_ref, grad_x_ref, grads_ref, reference_counts = layer_run(
        config.replace(attention_backend="unfused"), kind, state, hidden)
    assert {backend for backend, _ in reference_counts} == {"unfused"}
    fused_ops = {op for backend, op in fused_counts if backend != "unfused"}
    sparse = {"sparse_attention_fwd", "sparse_attention_bwd"}
    expected = {"W": sparse, "C": sparse | {"topk"}, "H": sparse, "M": {"dense_attention"}}[kind]
    # Triton (W/C/H, and M at any head dim) and torch SDPA (M at head dims ≤ 256) are there on every CUDA
    # machine this package supports, so a layer that ran none of them lost its fused path.
    assert fused_ops & expected, f"no fused backend ran {sorted(expected)}: {fused_counts}"
    if kind == "M" and not overrides:  # qk 576 / v 512: no vendor kernel takes them
        assert fused_counts.get(("triton", "dense_attention")) == 1, fused_counts
    if kind == "C":  # the selection's top-k and rows come from Triton kernels wherever Triton runs
        assert fused_counts.get(("triton", "topk")) == 1, fused_counts
        assert fused_counts.get(("triton", "selection_rows")) == 1, fused_counts
    assert_close_bf16("out", out, out_ref, grad=False)
    assert_close_bf16("d hidden", grad_x, grad_x_ref, grad=True)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        # The indexer is trained only by its KL loss, a difference of nearly equal probabilities
        # whose bf16 error is amplified (see tests/distributed.py): cosine ≥ 0.99 there.
        if "indexer" in name:
            assert cosine(grads[name], grads_ref[name]) >= 0.99, name
        else:
            assert_close_bf16(name, grads[name], grads_ref[name], grad=True)


@pytest.mark.parametrize("kind, overrides", [("W", {}), ("C", {}), ("H", {}), ("M", M_FUSABLE), ("M", {})],
                         ids=["W", "C", "H", "M_192_128", "M"])
def test_fused_layer_never_changes_a_saved_tensor(kind, overrides) -> None:
    """A1.1 on the fused path (`auto`): every tensor autograd saved, ours and the kernels', is
    unchanged when backward reads it (version counter and a bitwise copy: a kernel writing through
    a raw pointer does not bump the version)."""
    config = HybridAttentionConfig.from_preset("dsv4-flash", num_layers=1, layer_pattern=kind, **overrides)
    layer = HybridAttention(config, kind=kind).to(CUDA, torch.bfloat16).train()
    x = torch.randn(1024, 1, config.hidden_size, device=CUDA).bfloat16().requires_grad_()
    reset_call_counts()
    with SavedTensorGuard().watching() as guard:
        out, _ = layer(x)
        out.float().square().sum().backward()
    assert guard.packed > 0 and guard.unpacked > 0
    assert any(backend != "unfused" for backend, _ in call_counts()), call_counts()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kind", ["W", "C", "H"])
def test_fused_layer_cuda_graph_replay_matches_eager(kind) -> None:
    """The fused layer (`auto`: Triton, and cuDNN where installed) is capturable as one CUDA graph of
    forward + backward: replayed on new input it gives what an eager step gives.

    Tolerance: the same kernels on the same values, except for atomics-accumulated gradients (dkv,
    the indexer keys) whose float32 summation order changes run to run, so the bf16 bounds of the
    other layer tests hold with a wide margin; a replay reusing stale inputs or a stale selection
    would be far off."""
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset("dsv4-flash", num_layers=1, layer_pattern=kind)
    layer = HybridAttention(config, kind=kind).to(CUDA, torch.bfloat16).train()
    params = list(layer.parameters())
    static_x = torch.randn(1024, 1, config.hidden_size, device=CUDA).bfloat16().requires_grad_()
    static_grad = torch.randn_like(static_x)

    def step():
        out, _ = layer(static_x)
        return (out, *torch.autograd.grad(out, [static_x, *params], static_grad, allow_unused=True))

    graph, captured = capture_graph(step, before_capture=reset_call_counts)
    assert any(backend != "unfused" for backend, _ in call_counts()), call_counts()

    with torch.no_grad():
        static_x.copy_(torch.randn_like(static_x))
        static_grad.copy_(torch.randn_like(static_grad))
    graph.replay()
    eager = step()
    names = ["out", "d hidden"] + [name for name, _ in layer.named_parameters()]
    for name, replayed, expected in zip(names, captured, eager):
        if expected is None:
            assert replayed is None, name
        elif "indexer" in name:  # trained by the KL loss only: see the auto-vs-unfused test above
            assert cosine(replayed, expected) >= 0.99, name
        else:
            assert_close_bf16(name, replayed, expected, grad=name != "out")
