"""Decode attention (`ops.decode_attention`, the Triton kernel `backends/triton_kernels/decode_attention.py`)
and captured decode steps (`layers.decode_graph.DecodeGraph`).

The CPU cases of the kernel run in the Triton interpreter in a child process
(`interp_triton_decode_attention.py`; `triton_support.py` says why a child process). Here: dispatch (auto,
explicit requests that cannot run, the counters), input checks, undoing a warm-up step, and the GPU tests
(`gpu` marker) with their tolerances stated where they are used.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_dsa.backends import BackendUnavailableError, call_counts, reset_call_counts
from megatron_dsa.layers import DecodeGraph
from megatron_dsa.layers.decode_graph import _StepWrites
from megatron_dsa.layers.decoding import LayerCache
from megatron_dsa.layers.kinds import build_attention
from megatron_dsa.ops.decode_attention import decode_attention as reference_decode
from interp_triton_decode_attention import decode_inputs, decoding_config
from triton_support import compile_for_sm90, ptxas_report, run_interpreted, without_interpreter  # noqa: F401

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_interpreter_cases():
    """The kernel against the reference op, and decode steps through it against the reference decode (fp32,
    interpreter), in a child process."""
    run_interpreted("interp_triton_decode_attention.py")


def test_auto_decodes_through_the_unfused_ops_on_cpu():
    """Each decode step of a C layer attends through the decode family and scores the cached keys once
    through the decode scores family (no reference step, and the training family's candidate ids are never
    built)."""
    layer = build_attention(decoding_config("C"), kind="C").eval()
    cache = LayerCache.for_layer(layer, 2, 12)
    hidden = torch.randn(12, 2, layer.config.hidden_size)
    with torch.no_grad():
        layer(hidden[:5], inference_cache=cache)
        reset_call_counts()
        for t in range(5, 12):
            layer(hidden[t:t + 1], inference_cache=cache)
    counts = call_counts()
    assert counts[("unfused", "decode_attention")] == 7
    assert counts[("unfused", "decode_indexer_scores")] == 7 and counts[("unfused", "topk")] == 7
    assert not any(op in ("sparse_attention_fwd", "indexer_scores") for _, op in counts)


def test_an_explicit_triton_request_that_cannot_run_says_why(without_interpreter, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, wherever it runs
    config = decoding_config("C").replace(attention_backend_overrides={"decode_attention": "triton"})
    with pytest.raises(BackendUnavailableError, match="'triton' cannot run decode_attention: tensors on cpu"):
        build_attention(config, kind="C")


@pytest.mark.parametrize("argument, change, error", [
    ("kv_new", lambda i: dict(kv_new=i["kv_new"][:, :8]), ValueError),
    ("window_rows", lambda i: dict(window_rows=i["window_rows"][:2]), ValueError),
    ("seqlens", lambda i: dict(seqlens=i["seqlens"].float()), ValueError),
    ("sink", lambda i: dict(sink=i["sink"][:2]), ValueError),
    ("entries", lambda i: dict(entries=i["entries"].double()), TypeError),
    ("entry_ids", lambda i: dict(entry_ids=i["entry_ids"][0]), ValueError),
    ("entry_ids given without entries", lambda i: dict(entries=None), ValueError),
    ("ratio", lambda i: dict(ratio=1), ValueError),
    ("window", lambda i: dict(window=0), ValueError),
])
def test_bad_decode_inputs_are_named(argument, change, error):
    inputs = {**decode_inputs(4, 32, ring=7, entries=9, picks=5), "window": 8}
    with pytest.raises(error, match=argument):
        reference_decode(**{**inputs, **change(inputs)})


@pytest.mark.parametrize("kind, options", [("C", {}), ("C", dict(fp8_indexer_keys=True)), ("M", {}),
                                           ("C", dict(fp8_attention_rows=True)), ("W", dict(fp8_attention_rows=True))],
                         ids=["C", "C_fp8_indexer_keys", "M", "C_fp8_attention_rows", "W_fp8_attention_rows"])
@torch.no_grad()
def test_a_warm_up_step_is_undone_exactly(kind, options):
    """What `DecodeGraph` saves before its warm-up steps covers everything a decode step writes: after one step
    (C: it completes an entry, position 7, ratio 4; M: it writes its latent row) and the restore, every buffer
    and length is as before (FP8 indexer keys: their codes and scales; FP8 attention rows: the pages and the
    entry's scratch row)."""
    layer = build_attention(decoding_config(kind), kind=kind).double().eval()
    cache = LayerCache.for_layer(layer, 2, 12, **options)
    hidden = torch.randn(8, 2, layer.config.hidden_size, dtype=torch.float64)
    layer(hidden[:7], inference_cache=cache)

    def state() -> list[torch.Tensor]:
        keys = None if cache.indexer_keys is None else cache.indexer_keys.view(torch.uint8)
        rows = [getattr(t, "pages", t) for t in (cache.window, cache.entries)]
        buffers = (cache.seqlens, *rows, cache.entry_scratch, keys, cache.indexer_key_scales, cache.latent,
                   *[s.rows for s in cache.compressors.values()])
        return [t.clone() for t in buffers if t is not None]

    before, longest = state(), cache.longest
    writes = _StepWrites.save(cache)
    layer(hidden[7:8], inference_cache=cache)
    assert not all(torch.equal(a, b) for a, b in zip(state(), before))  # the step wrote something
    writes.restore()
    assert cache.longest == longest
    for now, then in zip(state(), before):
        assert torch.equal(now, then)


def test_two_value_parts_only_where_single_block_splits_leave_processors_idle():
    """`value_parts` from the shapes: the CPU's wave is `INTERPRETER_PROGRAMS` programs, a key block 16 slots."""
    from megatron_dsa.backends.triton_kernels.decode_attention import value_parts
    from megatron_dsa.backends.triton_kernels.tiles import INTERPRETER_PROGRAMS

    cpu = torch.device("cpu")
    assert INTERPRETER_PROGRAMS == 4
    assert value_parts(batch=1, heads=4, slots=32, dim=32, block_k=16, device=cpu) == 2  # 2 blocks: 4 programs
    assert value_parts(batch=1, heads=4, slots=33, dim=32, block_k=16, device=cpu) == 1  # 3 blocks: 6 programs
    assert value_parts(batch=2, heads=4, slots=32, dim=32, block_k=16, device=cpu) == 1
    assert value_parts(batch=1, heads=4, slots=32, dim=48, block_k=16, device=cpu) == 1  # a tail of columns
    assert value_parts(batch=1, heads=4, slots=16, dim=16, block_k=16, device=cpu) == 1  # halves under one dot


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("paged", [False, True], ids=["rows", "fp8_pages"])
def test_the_split_kernel_compiles_for_sm90_and_two_value_parts_do_not_spill(parts, paged, tmp_path):
    """dsv4-flash's C step tiles (64 heads × 512 columns, 8 warps; 64 keys a block, FP8 pages `PAGED_BLOCK_K`):
    wgmma (and for bf16 rows pipelined gathers); one part of bf16 rows spills its accumulator (the reason for two
    parts), two parts nearly not at all. FP8 pages (448 codes in tiles of 64, 64 bf16 RoPE columns) decode their
    tiles in registers before the MMA: some hundred bytes a thread spill at 16 keys a block (thousands at 64)."""
    from megatron_dsa.backends.triton_kernels.decode_attention import PAGED_BLOCK_K

    from megatron_dsa.backends.triton_kernels import _decode_attention_kernels as kernels

    rows = "*u8" if paged else "*bf16"
    signature = dict(q_ptr="*bf16", new_ptr="*bf16", ring_ptr=rows, entries_ptr=rows, ids_ptr="*i64",
                     seqlens_ptr="*i64", sink_ptr="*fp32", out_ptr="*bf16", part_acc_ptr="*fp32", part_max_ptr="*fp32",
                     part_sum_ptr="*fp32", qk_scale="fp32", H="constexpr", D="constexpr", R="i32", RING_LIMIT="i32",
                     C="i32", K="i32", RATIO="i32", SLOTS="i32", SLOTS_PER_SPLIT="i32", RING_PAGE="i32",
                     ENTRY_PAGE="i32", SPLITS="constexpr", HAS_ENTRIES="constexpr", SELECTED="constexpr",
                     BLOCK_H="constexpr", BLOCK_K="constexpr", BLOCK_D="constexpr", BLOCK_DT="constexpr",
                     VALUE_PARTS="constexpr", PAGED="constexpr", NOPE="constexpr", TILE="constexpr",
                     ROW_BYTES="constexpr", SCALE_BYTES="constexpr", DOT_PRECISION="constexpr", CHAINED="constexpr")
    constexprs = dict(H=64, D=512, SPLITS=4, HAS_ENTRIES=True, SELECTED=True, BLOCK_H=64,
                      BLOCK_K=PAGED_BLOCK_K if paged else 64, BLOCK_D=512,
                      BLOCK_DT=0, VALUE_PARTS=parts, PAGED=paged, NOPE=448 if paged else 0, TILE=64 if paged else 1,
                      ROW_BYTES=576 if paged else 0, SCALE_BYTES=8 if paged else 0, DOT_PRECISION="tf32",
                      CHAINED=True)
    compiled = compile_for_sm90(kernels, "decode_attention_split_kernel", signature, constexprs, 8, 2)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and (paged or "cp.async" in ptx)
    spilled = int(re.search(r"(\d+) bytes spill stores", ptxas_report(ptx, tmp_path)).group(1))
    if paged:
        assert spilled <= 256, spilled
    else:
        assert spilled > 64 if parts == 1 else spilled <= 16, spilled


@pytest.mark.parametrize("half", [0, 32], ids=["plain", "turned_back"])
def test_the_combine_kernel_compiles_for_sm90_without_spills(half, tmp_path):
    """dsv4-flash's combine (D = 512, 4 splits), with and without the inverse RoPE of the last 64 columns."""
    from megatron_dsa.backends.triton_kernels import _decode_attention_kernels as kernels

    signature = dict(part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", sink_ptr="*fp32",
                     out_ptr="*bf16", seqlens_ptr="*i64", freq_ptr="*fp32", H="constexpr", D="constexpr",
                     SPLITS="constexpr", BLOCK_S="constexpr", BLOCK_D="constexpr", HALF="constexpr",
                     BLOCK_HALF="constexpr", CHAINED="constexpr")
    constexprs = dict(H=64, D=512, SPLITS=4, BLOCK_S=4, BLOCK_D=512, HALF=half, BLOCK_HALF=max(half, 1),
                      CHAINED=True)
    compiled = compile_for_sm90(kernels, "decode_combine_kernel", signature, constexprs, 4, 1)
    assert "0 bytes spill stores" in ptxas_report(compiled.asm["ptx"], tmp_path)


def test_a_decode_graph_needs_cuda():
    layer = build_attention(decoding_config("M"), kind="M")
    cache = LayerCache.for_layer(layer, 1, 4)
    step = lambda x: layer(x, inference_cache=cache)[0]  # noqa: E731
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraph(step, torch.zeros(1, 1, layer.config.hidden_size), [cache])


# ---------------------------------------------------------------- GPU
def gpu_decode_inputs(entries: str, batch: int = 4, heads: int = 64, dim: int = 512, ring: int = 127,
                      capacity: int = 2048, picks: int = 512):
    """dsv4-flash decode shapes at an 8k context (ratio 4: 2048 entries), lengths ragged, one sequence empty."""
    g = torch.Generator(device="cuda").manual_seed(0)
    seqlens = torch.tensor([0, 100, 3000, 4 * capacity - 1], device="cuda")[:batch]
    inputs = dict(query=torch.randn(batch, heads, dim, device="cuda", generator=g),
                  kv_new=torch.randn(batch, dim, device="cuda", generator=g),
                  window_rows=torch.randn(batch, ring, dim, device="cuda", generator=g), seqlens=seqlens,
                  entries=torch.randn(batch, capacity, dim, device="cuda", generator=g),
                  entry_ids=torch.randint(-1, capacity, (batch, picks), device="cuda", generator=g), ratio=4,
                  sink=torch.randn(heads, device="cuda", generator=g), scale=dim ** -0.5, window=ring + 1)
    if entries != "selected":
        inputs["entry_ids"] = None
    if entries == "none":
        inputs["entries"] = None
    return inputs


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("entries", ["none", "every", "selected"])
@pytest.mark.parametrize("parts", [1, 2], ids=["one_value_part", "two_value_parts"])
def test_bf16_triton_decode_matches_the_float64_reference_on_the_gpu(entries, parts):
    """bf16 kernel against the float64 reference on the same bf16-rounded inputs, at dsv4-flash dims (H = 64,
    D = 512, window 128, 2048 entries or top-512), with several key splits, one or two value parts.

    Tolerance, atol = 2⁻⁷ · max|kv|: scores are exact products of bf16 values summed in fp32 (relative error
    ~1e-6); the probabilities are rounded to bf16 before the PV product (≤ 2⁻⁸ relative each, so ≤ 2⁻⁸ · max|kv|
    over a convex combination) and the output is rounded to bf16 (≤ 2⁻⁸ · |out| ≤ 2⁻⁸ · max|kv|)."""
    from megatron_dsa.backends.triton_kernels.decode_attention import decode_attention as triton_decode
    from megatron_dsa.backends.triton_kernels.decode_attention import decode_tiles

    inputs = gpu_decode_inputs(entries)
    rounded = {k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() and k != "sink" else v
               for k, v in inputs.items()}
    as_double = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in rounded.items()}
    expected = reference_decode(**as_double)
    got = triton_decode(**rounded, tiles=decode_tiles(torch.bfloat16, 64, 512)._replace(parts=parts))
    assert got.dtype == torch.bfloat16
    kv_scale = max(float(t.abs().max()) for t in (inputs["kv_new"], inputs["window_rows"]))
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2 ** -7 * kv_scale)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("splits", [1, 4], ids=["one_split", "four_splits"])
def test_two_value_parts_give_one_parts_bits(splits):
    """Metamorphic: two programs each owning half of the output's columns give the output of one owning all, bit for
    bit (bf16, dsv4-flash dims, the same splits). Both parts add the low half's score products first, as one part's
    MMA chain over all columns does, so every part's maxima and sums are the numbers one part finds; with one split
    each part normalises its own half by them."""
    from megatron_dsa.backends.triton_kernels.decode_attention import decode_attention as triton_decode
    from megatron_dsa.backends.triton_kernels.decode_attention import decode_tiles

    inputs = {k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() and k != "sink" else v
              for k, v in gpu_decode_inputs("selected").items()}
    tiles = decode_tiles(torch.bfloat16, 64, 512)
    one = triton_decode(**inputs, splits=splits, tiles=tiles._replace(parts=1))
    two = triton_decode(**inputs, splits=splits, tiles=tiles._replace(parts=2))
    assert torch.equal(two, one)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("entries", ["none", "selected"])
@pytest.mark.parametrize("parts", [1, 2], ids=["one_value_part", "two_value_parts"])
def test_the_combine_turns_the_output_back_as_the_rope_kernel_does(entries, parts):
    """bf16 at dsv4-flash dims (four sequences: several key splits, so the combine runs): the combine's inverse RoPE
    gives the bits of the attention's output then the RoPE kernel (the same roundings: the output rounded to bf16,
    then `rotate_pairs`)."""
    from megatron_dsa.backends.triton_kernels.decode_attention import decode_attention as triton_decode
    from megatron_dsa.backends.triton_kernels.decode_attention import decode_tiles
    from megatron_dsa.backends.triton_kernels.rope import rope as triton_rope
    from megatron_dsa.ops.rope import yarn_inv_freq

    inputs = {k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() and k != "sink" else v
              for k, v in gpu_decode_inputs(entries).items()}
    freq = yarn_inv_freq(64, 10000.0, 4.0, 4096).float().cuda()
    tiles = decode_tiles(torch.bfloat16, 64, 512)._replace(parts=parts)
    separate = triton_rope(triton_decode(**inputs, tiles=tiles), inputs["seqlens"], freq, inverse=True)
    turned = triton_decode(**inputs, tiles=tiles, inverse_rope_freq=freq)
    assert torch.equal(turned, separate)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind, options", [("W", {}), ("C", {}), ("C", dict(fp8_indexer_keys=True)), ("H", {}),
                                           ("M", {}), ("C", dict(fp8_attention_rows=True))],
                         ids=["W", "C", "C_fp8_indexer_keys", "H", "M", "C_fp8_attention_rows"])
@torch.no_grad()
def test_a_captured_decode_step_replays_the_eager_steps(kind, options):
    """Prefill two identical caches; decode 12 tokens eagerly on one and by `DecodeGraph` replays on the other:
    same outputs and caches. The Triton decode kernel ran in the capture (counters; FP8 attention rows: the Triton
    row writes, and the attention on whichever backend `auto` finds, FlashMLA where built, else the reference);
    the replays run the same kernels on the same values, so they agree to bf16 rounding at most (atol 2⁻⁸ ·
    max|out|: a cuBLAS GEMM may take another algorithm inside the capture)."""
    config = decoding_config(kind).replace(csa_window_size=16)
    torch.manual_seed(0)
    layer = build_attention(config, kind=kind).cuda().bfloat16().eval()
    hidden = torch.randn(40, 3, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    caches = [LayerCache.for_layer(layer, 3, 40, **options) for _ in range(2)]
    for cache in caches:
        layer(hidden[:27], inference_cache=cache)
    eager = torch.cat([layer(hidden[t:t + 1], inference_cache=caches[0])[0] for t in range(27, 39)])
    reset_call_counts()
    graph = DecodeGraph(lambda x: layer(x, inference_cache=caches[1])[0], hidden[27:28], [caches[1]])
    if options.get("fp8_attention_rows"):
        assert call_counts()[("triton", "paged_rows_write")] >= 2 and any(
            op == "paged_decode_attention" for _, op in call_counts()), call_counts()
    else:
        assert call_counts()[("triton", "decode_attention")] >= 1
    assert caches[1].seqlens.tolist() == [27] * 3 and caches[1].longest == 27  # warm-up undone
    replayed = torch.cat([graph(hidden[t:t + 1]).clone() for t in range(27, 39)])
    scale = float(eager.abs().max())
    torch.testing.assert_close(replayed, eager, rtol=0, atol=2 ** -8 * scale)
    assert torch.equal(caches[1].seqlens, caches[0].seqlens) and caches[1].longest == 39
    graph(hidden[39:40])  # the 40th token: the cache is full
    with pytest.raises(ValueError, match="capacity"):
        graph(hidden[39:40])
