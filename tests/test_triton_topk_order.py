"""Triton top-k and ordering of top-k picks (`backends.triton_kernels.topk_order`): the `topk` op family's
Triton backend, and the ordering the cuDNN top-k adapter uses.

CPU: the kernel runs in the Triton interpreter in a child process (`interp_triton_topk_order.py`); the
dispatcher's choice and the input checks run here.
GPU: dsv4-flash shapes (4096 rows, 1024 columns, top-512; 4096 columns for S = 16k) against the torch
forms, exactly.
"""

import pytest
import torch

import megatron_dsa.backends.triton as triton_backend
from megatron_dsa.backends import OpFamily, registered_backends
from megatron_dsa.backends.registry import Backend
from megatron_dsa.backends.cudnn import _in_reference_order
from megatron_dsa.backends.triton import TRITON
from megatron_dsa.backends.triton_kernels.topk_order import (AUTO_MAX_COLUMNS, MAX_WIDTH, SELECT_AUTO_MAX_ROWS,
                                                             order_picks, topk)
from megatron_dsa.ops.indices import topk_columns
from triton_support import compile_for_sm90, ptxas_report, run_interpreted, without_interpreter  # noqa: F401


def test_interpreted_kernels():
    run_interpreted("interp_triton_topk_order.py")


@pytest.mark.parametrize("kernel, extra", [
    ("select_digit_kernel", dict(hist_ptr="*i32", tickets_ptr="*i32", state_ptr="*i64", C="i32", K="i32",
                                 CHUNK="i32", PROGRAMS="i32", LEVEL="constexpr")),
    ("select_count_kernel", dict(state_ptr="*i64", part_ptr="*i32", C="i32", CHUNK="i32", PROGRAMS="i32")),
    ("select_write_kernel", dict(state_ptr="*i64", part_ptr="*i32", picked_ptr="*i64", C="i32", K="i32",
                                 CHUNK="i32", PROGRAMS="i32", BLOCK_P="constexpr")),
])
@pytest.mark.parametrize("has_valid", [True, False], ids=["mask", "counts"])
def test_select_kernels_compile_for_sm90_without_spills(kernel, extra, has_valid, tmp_path):
    """The radix select's kernels (the masked histograms and the ticket among them) compile for sm_90a as a decode
    step launches them (chained), without spills."""
    from megatron_dsa.backends.triton_kernels import _topk_order_kernels as kernels
    from megatron_dsa.backends.triton_kernels import topk_order

    signature = dict(scores_ptr="*fp32", valid_ptr="*i1", counts_ptr="*i64", **extra, BLOCK="constexpr",
                     HAS_VALID="constexpr", CHAINED="constexpr")
    constexprs = dict(BLOCK=topk_order.SELECT_BLOCK, HAS_VALID=has_valid, CHAINED=True,
                      **({"LEVEL": 1} if "LEVEL" in extra else {}), **({"BLOCK_P": 16} if "BLOCK_P" in extra else {}))
    compiled = compile_for_sm90(kernels, kernel, signature, constexprs, topk_order.SELECT_WARPS)
    assert "0 bytes spill stores" in ptxas_report(compiled.asm["ptx"], tmp_path)


def test_bad_inputs_name_the_rule():
    picked, ranked, valid = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match="float32 ranked"):
        order_picks(picked, ranked.double(), valid)
    with pytest.raises(ValueError, match="narrower than valid"):
        order_picks(picked, ranked[:, :2], valid)
    with pytest.raises(ValueError, match="at most"):
        order_picks(torch.zeros(2, 5000, dtype=torch.long), ranked, valid)


def test_topk_bad_inputs_name_the_rule():
    scores, valid = torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match="float32/bfloat16/float16 scores"):
        topk(scores.double(), valid, 2)
    with pytest.raises(TypeError, match="bool valid"):
        topk(scores, valid.int(), 2)
    with pytest.raises(ValueError, match="valid mask of their shape"):
        topk(scores, valid[:, :3], 2)
    with pytest.raises(ValueError, match="non-negative int"):
        topk(scores, valid, -1)
    with pytest.raises(ValueError, match=f"at most {MAX_WIDTH} picks per row, got k = {MAX_WIDTH + 1}"):
        topk(torch.zeros(1, MAX_WIDTH + 1), torch.ones(1, MAX_WIDTH + 1, dtype=torch.bool), MAX_WIDTH + 1)


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="cannot run on picked's device"):
        order_picks(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="top-k cannot run on scores' device"):
        topk(torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool), 2)


def test_auto_prefers_triton_topk_up_to_1024_columns_or_for_few_rows_cudnn_declines(monkeypatch):
    """The selection runs while the GPU waits for the host: Triton's one launch ranks before cuDNN's
    frontend call. Wider rows (slower in registers) go to the next backend under `auto`, unless the call says
    they are few (a decode step: one row per sequence) and cuDNN's top-k, faster there, declines them: then the
    select-then-sort path serves them. Asked for by name any width runs, up to k = MAX_WIDTH picks."""
    pytest.importorskip("triton")
    order = [backend.name for backend in registered_backends(OpFamily.TOPK)]
    assert order.index("triton") < order.index("cudnn") < order.index("unfused")
    call = dict(device=torch.device("cuda"), dtype=torch.float32, topk=512)
    auto, named = {**call, "explicit": False}, {**call, "explicit": True}
    few_wide = {**auto, "columns": 32768, "rows": SELECT_AUTO_MAX_ROWS}
    assert TRITON.decline_reason(OpFamily.TOPK, {**auto, "columns": AUTO_MAX_COLUMNS}) is None
    assert "slower" in TRITON.decline_reason(OpFamily.TOPK, {**auto, "columns": AUTO_MAX_COLUMNS + 1})
    assert "unknown number of rows" in TRITON.decline_reason(OpFamily.TOPK, {**auto, "columns": 32768})
    many = SELECT_AUTO_MAX_ROWS + 1
    assert f"{many} rows" in TRITON.decline_reason(OpFamily.TOPK, {**few_wide, "rows": many})
    assert TRITON.decline_reason(OpFamily.TOPK, {**named, "columns": 32768}) is None
    too_many = TRITON.decline_reason(OpFamily.TOPK, {**named, "columns": 32768, "topk": MAX_WIDTH + 1})
    assert f"exceeds the {MAX_WIDTH} picks" in too_many

    asked = []

    def cudnn_decline(op, call):
        asked.append((op, call["rows"], call["columns"]))
        return cudnn_answer

    cudnn = Backend(name="cudnn", ops={OpFamily.TOPK: lambda *args, **kwargs: None}, probe=cudnn_decline)
    monkeypatch.setattr(triton_backend, "backend_named", {"cudnn": cudnn}.get)
    cudnn_answer = "not installed"
    assert TRITON.decline_reason(OpFamily.TOPK, few_wide) is None
    cudnn_answer = None
    assert "cuDNN's top-k selects wide rows faster" in TRITON.decline_reason(OpFamily.TOPK, few_wide)
    assert TRITON.decline_reason(OpFamily.TOPK, {**few_wide, "explicit": True}) is None
    assert TRITON.decline_reason(OpFamily.TOPK, {**few_wide, "columns": AUTO_MAX_COLUMNS}) is None
    assert asked == [(OpFamily.TOPK, SELECT_AUTO_MAX_ROWS, 32768)] * 2


def test_the_layer_tells_the_dispatcher_its_top_k_width(monkeypatch):
    """The width rule needs the scores' column count in the call description: the C layer's selection
    passes it (visible entries per row: S / ratio)."""
    from megatron_dsa import HybridAttention, HybridAttentionConfig
    from megatron_dsa.layers import compressed_attention

    seen, original = [], compressed_attention.dispatch

    def recording(op, requested, **call):
        if op is OpFamily.TOPK:
            seen.append(call)
        return original(op, requested, **call)

    monkeypatch.setattr(compressed_attention, "dispatch", recording)
    config = HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern="C", dsa_indexer_topk=3)
    layer = HybridAttention(config, kind="C")
    layer(torch.randn(32, 1, config.hidden_size))
    ratio = config.compress_ratio(layer.kind)
    assert [call["columns"] for call in seen] == [32 // ratio]


@pytest.mark.gpu
def test_gpu_matches_torch_ordering_at_dsv4_shapes():
    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, cols, width = 4096, 1024, 512
    ranked = torch.randn(rows, cols, device="cuda", generator=gen).round(decimals=1)  # many exact ties
    valid = torch.rand(rows, cols, device="cuda", generator=gen) < 0.9
    picked = torch.rand(rows, cols, device="cuda", generator=gen).argsort(1)[:, :width].to(torch.int32)
    picked[:, ::37] = -1
    assert torch.equal(order_picks(picked, ranked, valid), _in_reference_order(picked.long(), ranked, valid))


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [1024, MAX_WIDTH])  # S = 4096 and 16384 at ratio 4
def test_gpu_topk_matches_topk_columns_at_dsv4_shapes(cols):
    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = 4096
    scores = torch.randn(rows, cols, device="cuda", generator=gen).round(decimals=1)  # many exact ties
    valid = torch.arange(cols, device="cuda") < torch.randint(0, cols + 1, (rows, 1), device="cuda", generator=gen)
    valid[7] = False
    got = topk(scores, valid, 512)
    assert torch.equal(got, topk_columns(scores, valid, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [1024, MAX_WIDTH])  # sorted whole; selected, then sorted
def test_gpu_topk_ranks_valid_minus_inf_columns_like_topk_columns(cols):
    """Valid columns scoring −inf among scattered invalid ones (not a prefix): Triton picks them before any −1,
    exactly as the reference does."""
    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = 512
    scores = torch.randn(rows, cols, device="cuda", generator=gen).round(decimals=1)
    scores = scores.masked_fill(torch.rand(rows, cols, device="cuda", generator=gen) < 0.5, float("-inf"))
    valid = torch.rand(rows, cols, device="cuda", generator=gen) < 0.6
    got = topk(scores, valid, 512)
    assert torch.equal(got, topk_columns(scores, valid, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("scores_kind", ["ties", "distinct"])
def test_gpu_decode_topk_matches_topk_columns_exactly(scores_kind):
    """A C layer's decode top-k at 128k tokens: 32 rows of 32768 columns (ratio 4), top-512, valid a prefix of
    ragged length (none, fewer than k, all) and −inf after it as the decode scores have; Triton named (the
    select-then-sort path, counted) and exactly the reference's columns and order. "ties": eight score values,
    so the 512th score is tied thousands of times; "distinct": random float32 scores."""
    from megatron_dsa.backends import call_counts, dispatch, reset_call_counts

    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows, cols = 32, 32768
    scores = torch.randn(rows, cols, device="cuda", generator=gen)
    if scores_kind == "ties":
        scores = scores.mul(2).round().clamp(-4, 3)
    counts = torch.randint(0, cols + 1, (rows,), device="cuda", generator=gen)
    counts[:3] = torch.tensor([0, 300, cols])
    valid = torch.arange(cols, device="cuda") < counts.unsqueeze(1)
    scores = scores.masked_fill(~valid, float("-inf"))
    reset_call_counts()
    pick = dispatch(OpFamily.TOPK, "triton", device=scores.device, dtype=scores.dtype, topk=512, columns=cols,
                    rows=rows)
    got = pick(scores, valid, 512, None)
    assert call_counts() == {("triton", "topk"): 1}
    assert torch.equal(got, topk_columns(scores, valid, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cudnn"])
def test_gpu_unordered_decode_topk_is_the_reference_set(backend):
    """`ordered=False` with the counts hint, as a decode step calls it (32 rows of 32768 columns, top-512, ragged
    valid prefixes: none, fewer than k, all): as a set per row exactly the reference's columns, each once, every
    slot without a pick −1 or past its row's prefix (what the decode attention ignores). Distinct scores: the
    kernels may break ties differently from the reference's order."""
    from megatron_dsa.backends import BackendUnavailableError, call_counts, dispatch, reset_call_counts

    gen = torch.Generator(device="cuda").manual_seed(4)
    rows, cols = 32, 32768
    scores = torch.randn(rows, cols, device="cuda", generator=gen)
    counts = torch.randint(0, cols + 1, (rows,), device="cuda", generator=gen)
    counts[:3] = torch.tensor([0, 300, cols])
    valid = torch.arange(cols, device="cuda") < counts.unsqueeze(1)
    try:
        pick = dispatch(OpFamily.TOPK, backend, device=scores.device, dtype=scores.dtype, topk=512, columns=cols,
                        rows=rows)
    except BackendUnavailableError as error:
        if backend != "cudnn":  # Triton runs on every GPU this package supports: its decline is a failure
            raise
        pytest.skip(f"cuDNN's top-k needs the optional cuDNN frontend (`[cudnn]` extra), not usable here: {error}")
    want = topk_columns(scores, valid, 512).sort(dim=1, descending=True).values
    for mask in (valid, None):  # a decode step passes no mask: its counts say the prefixes
        reset_call_counts()
        got = pick(scores, mask, 512, counts=counts, ordered=False)
        assert call_counts() == {(backend, "topk"): 1}
        inside = (got >= 0) & (got < counts.unsqueeze(1))
        as_set = torch.where(inside, got, -1).sort(dim=1, descending=True).values
        assert torch.equal(as_set, want)


@pytest.mark.gpu
def test_gpu_select_split_over_programs_replays_in_a_graph_as_the_reference():
    """A decode batch (32 rows of 32768 columns, top-512, valid prefixes from the counts, many exact ties): each row
    split over several programs that meet through their histograms and a ticket in memory; eager, then captured in
    a CUDA graph with chained launches and replayed five times, the reference set in column order every time (the
    kernels leave the workspace zeroed for the next replay)."""
    from megatron_dsa.backends import chained_launches
    from megatron_dsa.backends.triton_kernels import topk_order

    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, cols, k = 32, 32768, 512
    scores = torch.randn(rows, cols, device="cuda", generator=gen).mul(2).round().clamp(-4, 3)
    counts = torch.randint(0, cols + 1, (rows,), device="cuda", generator=gen)
    counts[:3] = torch.tensor([0, 300, cols])
    valid = torch.arange(cols, device="cuda") < counts.unsqueeze(1)
    expected = topk_columns(scores, valid, k)
    expected = torch.where(expected >= 0, expected, cols).sort(dim=1).values  # column order, −1 last
    expected = torch.where(expected < cols, expected, -1)
    assert topk_order._programs_per_row(scores.device, rows, cols, topk_order.SELECT_BLOCK) > 1
    assert torch.equal(topk_order.select_top_columns(scores, None, k, counts), expected)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), chained_launches():
        topk_order.select_top_columns(scores, None, k, counts)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), chained_launches():
        picked = topk_order.select_top_columns(scores, None, k, counts)
    for _ in range(5):
        picked.fill_(-7)
        graph.replay()
        assert torch.equal(picked, expected)
