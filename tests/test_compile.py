"""`torch.compile(layer, fullgraph=True)` traces every kind whole and matches eager (outputs, input and
parameter gradients, the indexer loss); each op family's custom op passes `torch.library.opcheck`.

CPU runs the unfused reference backend under `aot_eager` (Dynamo + AOTAutograd with the fake
implementations and registered backwards, without code generation: what a full-graph trace needs)
and one kind under `inductor`. Tolerance: float32 with rtol 1e-4 / atol 1e-5; the compiled path runs the
same reference kernels, but the grouped output projection is a plain einsum there (the compiler cannot
trace the strided `out=` GEMM) and inductor reorders sums, so results agree to float32 rounding, not bitwise.
The GPU tests compile the fused Triton kernels with inductor in bf16 and check, through the call counters,
that they ran; there compiled and eager are each compared with a float64 step (inductor keeps fused
intermediates in float32, so bf16 results differ from eager's by eager's own rounding error).
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import AUTO_ORDER, OpFamily, call_counts, library, reset_call_counts
from megatron_dsa.ops.indices import visible_compressed_entries, window_indices
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.paged_rows import PagedRows, write_rows
from megatron_dsa.packed_seq import PackedSeqParams
from reference_layer import randomize_parameters_

KINDS = ("W", "C", "H", "M")
RTOL, ATOL = 1e-4, 1e-5
# Op families each kind runs in training (forward and backward), by the custom ops' counters.
FAMILIES = {
    "W": {"rms_norm", "rope", "norm_rope", "sparse_attention_fwd", "sparse_attention_bwd"},
    "H": {"rms_norm", "rope", "norm_rope", "compressor", "sparse_attention_fwd", "sparse_attention_bwd"},
    "C": {"rms_norm", "rope", "norm_rope", "compressor", "indexer_scores", "topk", "selection_rows", "indexer_loss",
          "indexer_kl_bwd", "sparse_attention_fwd", "sparse_attention_bwd"},
    "M": {"rms_norm", "rope", "dense_attention"},
}


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer(kind: str, dtype: torch.dtype = torch.float32, device: str = "cpu", **overrides) -> HybridAttention:
    config = HybridAttentionConfig.from_preset("tiny", **overrides)
    layer = HybridAttention(config, kind=kind).to(device=device, dtype=dtype)
    randomize_parameters_(layer, seed=7)
    return layer.train()


def _step(layer, x: torch.Tensor, **kwargs):
    """Output, input gradient and every parameter gradient of one training step (sum of the output)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, _ = layer(x, **kwargs)
    out.float().square().sum().backward()
    grads = {name.removeprefix("_orig_mod."): p.grad for name, p in layer.named_parameters()}
    loss = getattr(layer, "last_indexer_loss", None)
    return out.detach(), x.grad, grads, loss


def _assert_steps_equal(eager, compiled, rtol: float, atol: float) -> None:
    (out, grad_x, grads, loss), (c_out, c_grad_x, c_grads, c_loss) = eager, compiled
    torch.testing.assert_close(c_out, out, rtol=rtol, atol=atol)
    torch.testing.assert_close(c_grad_x, grad_x, rtol=rtol, atol=atol)
    assert set(c_grads) == set(grads)
    for name, grad in grads.items():
        assert grad is not None, name
        torch.testing.assert_close(c_grads[name], grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    if loss is not None:
        torch.testing.assert_close(c_loss, loss, rtol=rtol, atol=atol)


def _compiled_families(backend: str) -> set[str]:
    return {op for (name, op), calls in call_counts().items() if name == backend and calls}


@pytest.mark.parametrize("kind", KINDS)
def test_fullgraph_compile_matches_eager(kind):
    layer = _layer(kind)
    x = torch.randn(32, 2, layer.config.hidden_size)
    eager = _step(layer, x)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager")
    reset_call_counts()
    _assert_steps_equal(eager, _step(compiled, x), RTOL, ATOL)
    # Counted by the custom ops when they ran inside the compiled graph (not while tracing).
    assert _compiled_families("unfused") == FAMILIES[kind]
    reset_call_counts()
    _step(compiled, x)  # a second step reuses the graph
    assert _compiled_families("unfused") == FAMILIES[kind]


@pytest.mark.parametrize("kind", ("C", "M"))
def test_fullgraph_compile_packed_matches_eager(kind):
    layer = _layer(kind)
    cu = torch.tensor([0, 20, 27, 48], dtype=torch.int32)
    padded = torch.tensor([0, 24, 32, 56], dtype=torch.int32)
    params = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_q_padded=padded, max_seqlen_q=24)
    x = torch.randn(64, 1, layer.config.hidden_size)
    eager = _step(layer, x, packed_seq_params=params)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager")
    _assert_steps_equal(eager, _step(compiled, x, packed_seq_params=params), RTOL, ATOL)


def test_packed_compile_needs_host_max_seqlen():
    layer = _layer("W")
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 20, 32], dtype=torch.int32))
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager")
    with pytest.raises(Exception, match="max_seqlen_q"):
        compiled(torch.randn(32, 1, layer.config.hidden_size), packed_seq_params=params)


@pytest.mark.slow
def test_inductor_compile_matches_eager():
    """Code generation too (C++ on CPU), for the W kind (the C kind takes about two minutes to compile on
    two busy CPU cores; the GPU tests compile every fused kind with inductor)."""
    layer = _layer("W")
    x = torch.randn(32, 2, layer.config.hidden_size)
    eager = _step(layer, x)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="inductor")
    _assert_steps_equal(eager, _step(compiled, x), RTOL, ATOL)


# ------------------------------------------------------------------------------ opcheck
def _layout(device: str = "cpu") -> TokenLayout:
    return TokenLayout.packed(torch.tensor([0, 12, 16], device=device), 20, torch.device(device),
                              torch.tensor([0, 12, 20], device=device), 12)


def _random_pages(batch: int, slots: int, g: torch.Generator, device: str) -> torch.Tensor:
    """FP8 pages (`ops.paged_rows`) of rows 16 wide (8 RoPE) with random rows in every slot."""
    paged = PagedRows.empty(batch, slots, 16, 8, device)
    write_rows(paged, torch.arange(batch, device=device).repeat_interleave(slots),
               torch.arange(slots, device=device).repeat(batch), torch.randn(batch * slots, 16, generator=g).to(device))
    return paged.pages


def _opcheck_samples(device: str = "cpu") -> dict[str, list[tuple]]:
    """Small inputs for each custom op (backend `unfused`), with and without the optional arguments."""
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *shape, grad=True: torch.randn(*shape, generator=g).to(device).requires_grad_(grad)  # noqa: E731
    layout, heads, dim, rope_dim = _layout(device), 2, 16, 8
    positions, inv_freq = layout.positions, torch.rand(rope_dim // 2, generator=g).to(device)
    compressed = layout.compressed(4)
    window_pages, entry_pages = (_random_pages(3, slots, g, device) for slots in (4, 5))
    entries = visible_compressed_entries(compressed)
    candidates = entries.rows()
    window = window_indices(layout, 4)
    kv_full_rows = layout.num_rows + compressed.capacity
    indices = torch.cat((window, torch.where(candidates >= 0, candidates + layout.num_rows, -1)), 1)
    q, kv = r(20, heads, dim), r(kv_full_rows, dim)
    iq, ik, iw = r(20, 2, 8, grad=False), r(compressed.capacity, 8, grad=False), r(20, 2, grad=False)
    scores = library.indexer_scores_op("unfused", iq, ik, iw, candidates, 0.3, None, [])
    valid = candidates >= 0
    columns = library.topk_op("unfused", scores, valid, 2, None, None, True)
    lse = r(20, heads, grad=False).float() + 3.0
    student = torch.where(valid, scores, float("-inf"))
    per_row, target = library.indexer_loss_op("unfused", student, q.detach(), kv.detach(), candidates, lse, 0.25)
    return {
        "rope": [("unfused", r(20, heads, dim), positions, inv_freq, False, 1.0),
                 ("unfused", r(20, dim), positions, inv_freq, True, 0.7)],
        "norm_rope": [("unfused", r(20, heads, dim), positions, inv_freq, 1e-6, None),
                      ("unfused", r(20, dim), positions, inv_freq, 1e-6, r(dim))],
        "rms_norm": [("unfused", r(20, dim), r(dim), 1e-6), ("unfused", r(20, dim), None, 1e-6)],
        "compressor": [("unfused", r(20, 2 * dim), r(20, 2 * dim), r(4, 2 * dim), r(dim), 1e-6, inv_freq, rotate,
                        *library._compressed_args(compressed)) for rotate in (False, True)],
        "dense_attention": [("unfused", r(20, 4, dim), r(20, 2, dim), r(20, 2, 8), *library._layout_args(layout),
                             0.25)],
        "dense_attention_block_fwd": [("unfused", r(6, 4, dim, grad=False), r(rows, 2, dim, grad=False),
                                       r(rows, 2, 8, grad=False), 0.25, rows == 6) for rows in (6, 9)],
        "dense_attention_block_bwd": [("unfused", r(6, 4, dim, grad=False), r(rows, 2, dim, grad=False),
                                       r(rows, 2, 8, grad=False), r(6, 4, 8, grad=False), r(6, 4, grad=False) + 3.0,
                                       r(6, 4, 8, grad=False), 0.25, rows == 6) for rows in (6, 9)],
        "sparse_attention_fwd": [("unfused", "auto", q, kv, indices, r(heads), 0.25)],
        "sparse_attention_bwd": [("unfused", q.detach(), kv.detach(), indices, r(heads, grad=False), 0.25,
                                  r(20, heads, dim, grad=False), lse, r(20, heads, dim, grad=False), grad_lse)
                                 for grad_lse in (None, r(20, heads, grad=False))],
        "indexer_scores": [("unfused", iq, ik, iw, candidates, 0.3, None, []),
                           # a `SegmentedVisibleRows` hint: its ints, then its tensors (one segment of the 20 rows)
                           ("unfused", iq, ik, iw, candidates, 0.3, [4, 20, 20, candidates.shape[1]],
                            [torch.tensor([0, 20], dtype=torch.int32, device=device),
                             torch.tensor([0, candidates.shape[1]], dtype=torch.int32, device=device),
                             torch.zeros(1, dtype=torch.int32, device=device),
                             torch.arange(candidates.shape[1], device=device)])],
        "topk": [("unfused", scores, valid, 2, None, None, True),
                 ("unfused", scores, valid, 9, None, valid.sum(1), False)],
        "selection_rows": [("unfused", columns, scores, entries.table, entries.group, entries.count, 0, 20,
                            window, layout.num_rows)],
        "indexer_loss": [("unfused", student, q.detach(), kv.detach(), candidates, lse, 0.25)],
        "indexer_kl_bwd": [("unfused", iq, ik, iw, candidates, target, student, per_row.detach(), 0.3)],
        "decode_attention": [("unfused", r(3, heads, dim, grad=False), r(3, dim, grad=False), r(3, 4, dim, grad=False),
                              torch.tensor([0, 3, 17], device=device), 5, entries_rows, entry_ids, 4,
                              r(heads, grad=False), 0.25, freq)
                             for entries_rows, entry_ids, freq in (
                                 (None, None, None), (r(3, 6, dim, grad=False), None, None),
                                 (r(3, 6, dim, grad=False), torch.tensor([[0, -1], [1, 0], [5, 2]], device=device),
                                  torch.rand(2, device=device)))],
        # (Its FP8-keys form, e4m3 keys with key_scales, is not sampled: opcheck's schema check compares inputs
        # with arithmetic torch does not implement for float8.)
        "decode_indexer_scores": [("unfused", r(3, 2, 8, grad=False), r(3, 6, 8, grad=False), r(3, 2, grad=False),
                                   torch.tensor([0, 4, 6], device=device), 0.3, None)],
        # state [B, K, 2·coff·Dc], new rows, positions, ape, norm weight, eps, inv_freq, rotate, store, scales:
        # ratio 4 (K = 8, coff 2, Dc 8) and ratio 2 (K = 2, coff 1); the FP8 store is not sampled, for the same reason.
        "decode_compressor": [("unfused", r(3, 2 * ratio, 4 * 8, grad=False), r(3, 4 * 8, grad=False),
                               torch.tensor([0, 5, 11], device=device), r(ratio, 2 * 8, grad=False),
                               r(8, grad=False), 1e-6, inv_freq, rotate, r(3, 6, 8, grad=False), None, counts)
                              for ratio, rotate, counts in ((4, False, None),
                                                            (4, True, torch.zeros(3, dtype=torch.int32,
                                                                                  device=device)))] + [
                              ("unfused", r(3, 2, 2 * 8, grad=False), r(3, 2 * 8, grad=False),
                               torch.tensor([0, 5, 11], device=device), r(2, 8, grad=False), r(8, grad=False), 1e-6,
                               inv_freq, False, r(3, 6, 8, grad=False), None, None)],
        # buffer [B, R, D] (a ring of 4 slots), new rows [B, D], seqlens [B] (the last two wrap around the ring)
        "decode_append": [("unfused", r(3, 4, 8, grad=False), r(3, 8, grad=False),
                           torch.tensor([0, 5, 11], device=device))],
        # FP8 pages (ops.paged_rows) of 3 sequences, rows of 16 (8 RoPE): a window ring of 4 slots, 5 entry slots
        "paged_decode_attention": [
            ("unfused", r(3, 2, 16, grad=False), window_pages, 4, 16, 8, torch.tensor([0, 5, 11], device=device),
             entry_pages, 5, torch.tensor([[0, -1], [1, 0], [2, 4]], device=device), 4, r(2, grad=False), 0.25,
             inv_freq[:4]),
            ("unfused", r(3, 2, 16, grad=False), window_pages, 4, 16, 8, torch.tensor([0, 5, 11], device=device),
             None, 0, None, 1, r(2, grad=False), 0.25, None)],
        "paged_rows_write": [("unfused", window_pages.clone(), 4, 16, 8, r(3, 16, grad=False),
                              torch.tensor([0, 5, 11], device=device), 1)],
        # (Its kept-codes form, e4m3 b with b_scales, is not sampled, for the same reason.)
        "fp8_gemm": [("unfused", r(5, 24, grad=False), r(7, 24, grad=False), torch.float32, None),
                     ("unfused", r(5, 24, grad=False), r(7, 24, grad=False), torch.bfloat16, None)],
    }


OPS = {
    "rope": library.rope_op, "norm_rope": library.norm_rope_op, "rms_norm": library.rms_norm_op,
    "compressor": library.compressor_op, "dense_attention": library.dense_attention_op,
    "dense_attention_block_fwd": library.dense_attention_block_fwd_op,
    "dense_attention_block_bwd": library.dense_attention_block_bwd_op,
    "sparse_attention_fwd": library.sparse_attention_fwd_op,
    "sparse_attention_bwd": library.sparse_attention_bwd_op, "indexer_scores": library.indexer_scores_op,
    "topk": library.topk_op, "selection_rows": library.selection_rows_op,
    "indexer_loss": library.indexer_loss_op, "indexer_kl_bwd": library.indexer_kl_bwd_op,
    "decode_attention": library.decode_attention_op, "decode_indexer_scores": library.decode_indexer_scores_op,
    "decode_compressor": library.decode_compressor_op, "decode_append": library.decode_append_op,
    "fp8_gemm": library.fp8_gemm_op, "paged_decode_attention": library.paged_decode_attention_op,
    "paged_rows_write": library.paged_rows_write_op,
}


def test_every_family_has_a_custom_op():
    assert set(OPS) == {op.value for op in OpFamily}
    assert set(library.ADAPTORS) | {OpFamily.SPARSE_ATTENTION_FWD, OpFamily.SPARSE_ATTENTION_BWD} == set(OpFamily)


@pytest.mark.parametrize("name", sorted(OPS))
def test_opcheck(name):
    for sample in _opcheck_samples()[name]:
        torch.library.opcheck(OPS[name], sample)


@pytest.mark.parametrize("name", ("dense_attention_block_fwd", "dense_attention_block_bwd"))
def test_opcheck_torch_sdpa_blocks_on_cpu(name):
    """torch's CPU flash kernel pads head dims to one width: the block ops still return what their fake
    implementation promises (contiguous results)."""
    for sample in _opcheck_samples()[name]:
        torch.library.opcheck(OPS[name], ("torch_sdpa", *sample[1:]))


def test_recomputed_backward_equals_the_backends_autograd():
    """`vjp` (norm_rope, rms_norm, compressor, dense attention) gives the eager kernels' own gradients."""
    samples = _opcheck_samples()
    for name in ("norm_rope", "rms_norm", "compressor", "dense_attention"):
        for sample in samples[name]:
            op = OPS[name]
            out = op(*sample)
            out = out[0] if isinstance(out, tuple) else out
            inputs = [a for a in sample if isinstance(a, torch.Tensor) and a.requires_grad]
            grads = torch.autograd.grad(out.square().sum(), inputs)
            fresh = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a
                     for a in sample]
            direct = _direct_forward(name, fresh)
            expected = torch.autograd.grad(direct.square().sum(),
                                           [a for a in fresh if isinstance(a, torch.Tensor) and a.requires_grad])
            for got, want in zip(grads, expected):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _direct_forward(name: str, args: list) -> torch.Tensor:
    from megatron_dsa.backends.registry import backend_op
    kernel = backend_op("unfused", OpFamily(name))
    if name == "norm_rope":
        return kernel(*args[1:6])
    if name == "rms_norm":
        return kernel(*args[1:4])
    if name == "compressor":
        kv, gate, ape, weight, eps, inv_freq, rotate, tensors, sizes = args[1:]
        return kernel(kv, gate, ape, weight, eps, library._compressed(tensors, sizes), inv_freq, rotate)
    q, k, v, tensors, sizes, scale = args[1:]
    return kernel(q, k, v, library._layout(tensors, sizes), scale)[0]


# ------------------------------------------------------------------------------ GPU: fused kernels
def _assert_as_close_to_float64_as_eager(eager, compiled, reference) -> None:
    """Each tensor of the compiled step (output, input and parameter gradients, indexer loss) is within 2× the
    eager step's error against the float64 `reference` step, plus 1% of the tensor's scale (max |reference|).

    Not element-wise against eager: in bf16, eager rounds every op's result to bf16, while inductor's
    generated kernels keep a fused chain of elementwise ops in float32 and round once at the end (the
    downcast-upcast pairs between fused ops are elided; torch's `emulate_precision_casts` documents
    this). Compiled and eager then differ by about eager's own error, which reaches ~1% of a gradient's
    scale (measured on CPU with float32 intermediates as the stand-in: 2 on a kv_layernorm gradient of
    scale 555), far outside rtol = atol = 2e-2 per element, while both stay equally close to float64. A
    compiled graph that drops a term, a kernel or a gradient is off by its whole size, far outside this."""
    (out, grad_x, grads, loss), (c_out, c_grad_x, c_grads, c_loss), (r_out, r_grad_x, r_grads, r_loss) = (
        eager, compiled, reference)
    assert set(c_grads) == set(grads) == set(r_grads)
    pairs = [("output", out, c_out, r_out), ("input grad", grad_x, c_grad_x, r_grad_x)]
    pairs += [(name, grads[name], c_grads[name], r_grads[name]) for name in grads]
    if r_loss is not None:
        pairs.append(("indexer loss", loss, c_loss, r_loss))
    for name, mine, theirs, truth in pairs:
        assert mine is not None and theirs is not None, name
        error = lambda t: float((t.double() - truth).abs().max())  # noqa: E731
        bound = 2 * error(mine) + 1e-2 * float(truth.abs().max())
        assert error(theirs) <= bound, (f"{name}: compiled error {error(theirs):.3g} against float64 exceeds "
                                        f"{bound:.3g} (eager's {error(mine):.3g})")


@pytest.mark.gpu
# Compared with eager element-wise in bf16 this cannot pass (inductor keeps float32 intermediates where eager
# rounds to bf16): both are held to their distance from a float64 run (`_assert_as_close_to_float64_as_eager`).
@pytest.mark.parametrize("kind", ("W", "C", "H"))
def test_fullgraph_compile_fused_triton_matches_eager(kind):
    layer = _layer(kind, torch.bfloat16, "cuda", attention_backend="triton")
    # Float64 on the unfused backend (Triton's attention has no float64 kernel), holding the bf16 weights exactly.
    reference = _layer(kind, torch.float64, "cuda", attention_backend="unfused")
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(64, 2, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    eager = _step(layer, x)
    expected = _step(reference, x.double())
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    reset_call_counts()
    _assert_as_close_to_float64_as_eager(eager, _step(compiled, x), expected)
    assert _compiled_families("triton") == FAMILIES[kind], call_counts()
    assert not _compiled_families("unfused"), call_counts()


# Families without a Triton kernel, and the fused CUDA backend that ships with torch (FlashAttention and cuDNN
# are optional packages).
_TORCH_CUDA_BACKEND = {"dense_attention_block_fwd": "torch_sdpa", "dense_attention_block_bwd": "torch_sdpa",
                       "fp8_gemm": "torch_scaled_mm"}


def _fused_cuda_backend(name: str) -> str:
    """The backend whose CUDA kernel `name`'s GPU opcheck drives: our Triton where the family has it."""
    return "triton" if "triton" in AUTO_ORDER[OpFamily(name)] else _TORCH_CUDA_BACKEND[name]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(set(OPS) - {"dense_attention"}))
def test_opcheck_fused_cuda(name):
    for sample in _opcheck_samples("cuda")[name]:
        args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in sample]
        torch.library.opcheck(OPS[name], (_fused_cuda_backend(name), *args[1:]))
