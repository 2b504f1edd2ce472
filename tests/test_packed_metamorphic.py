"""Packed (THD) input, metamorphic checks in float64 on CPU (docs/math.md §11, §8.5; bug
classes A3.6, A4.6, A5.2–A5.7).

The reference for a pack of segments is one ordinary `[L, 1, d]` call per segment: the layer must
never let RoPE, the window, compression, top-k or the indexer loss cross a segment boundary, and
padding / static-capacity tail rows (NaN-filled here) must contribute to nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from test_packed_support import (
    Packed, Run, assert_close, assert_filler_rows_zero, assert_grads_close, assert_loss_matches,
    assert_matches_separate, combine_separate, make_layer, pack, random_segments, run_each,
    run_layer, run_packed,
)

# Layer variants: every kind; for C both indexer losses and both reductions, and the dense mode.
VARIANTS = {
    "W": dict(kind="W"),
    "H": dict(kind="H"),
    "M": dict(kind="M"),
    "C-sparse-per_token": dict(kind="C", dsa_indexer_use_sparse_loss=True, calculate_per_token_loss=True),
    "C-sparse-mean": dict(kind="C", dsa_indexer_use_sparse_loss=True, calculate_per_token_loss=False),
    "C-dense-per_token": dict(kind="C", dsa_indexer_use_sparse_loss=False, calculate_per_token_loss=True),
    "C-dense-mean": dict(kind="C", dsa_indexer_use_sparse_loss=False, calculate_per_token_loss=False),
    "C-dense_mode": dict(kind="C", csa_dense_mode=True),
}
ONE_PER_KIND = ["W", "C-sparse-mean", "H", "M"]


def layer_for(variant: str, **overrides):
    options = dict(VARIANTS[variant], **overrides)
    return make_layer(options.pop("kind"), **options)


def check_packed_vs_separate(layer, lengths, pads=None, tail=0, **pack_options) -> tuple[Packed, Run]:
    """Pack random segments of `lengths`, run packed and per segment, compare everything."""
    width = layer.config.hidden_size
    segments = random_segments(lengths, width)
    grad_segments = random_segments(lengths, width)
    packed = pack(segments, pads, tail, **pack_options)
    run = run_packed(layer, packed, grad_segments)
    expected = combine_separate(layer, run_each(layer, segments, grad_segments), lengths)
    assert_matches_separate(packed, run, expected)
    return packed, run


# ------------------------------------------------------------------------------ packed == separate
@pytest.mark.parametrize("layout", ["padded_nan_tail", "exact_capacity"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_equals_separate_calls(variant, layout):
    """[A, B, C] packed == three separate calls: outputs, input grads, summed param grads and the
    indexer loss (per-token: the sum; mean: the row-weighted mean, see `combine_separate`)."""
    layer = layer_for(variant)
    if layout == "padded_nan_tail":
        packed, run = check_packed_vs_separate(layer, [21, 3, 34], pads=[3, 2, 5], tail=7)
    else:  # no padding, no tail: cu_seqlens_q[-1] == T
        packed, run = check_packed_vs_separate(layer, [21, 3, 34])
        assert int(packed.params.cu_seqlens_q[-1]) == packed.num_rows
    if layer.kind.value == "C" and not layer.config.csa_dense_mode:
        assert run.loss is not None and run.loss > 0  # the loss comparison was not vacuous


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_single_segment_thd_equals_sbhd(variant):
    """One segment filling the whole capacity (cu_seqlens = [0, T]) == the SBHD B=1 call."""
    layer = layer_for(variant)
    x, grad = random_segments([29, 29], layer.config.hidden_size)
    packed = pack([x])
    assert packed.params.cu_seqlens_q.tolist() == [0, packed.num_rows]
    thd = run_layer(layer, packed.hidden, grad.unsqueeze(1), packed.params)
    sbhd = run_layer(layer, x.unsqueeze(1), grad.unsqueeze(1))
    assert_close(thd.out, sbhd.out, "output")
    assert_close(thd.grad_in, sbhd.grad_in, "input grad")
    assert_grads_close(thd.grads, sbhd.grads, "param grads")
    assert_loss_matches(thd.loss, sbhd.loss)
    if sbhd.compressed is not None:
        assert torch.equal(thd.compressed, sbhd.compressed)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_padded_equals_unpadded(variant):
    """Per-segment padding changes nothing for real tokens (A3.6): outputs, input grads, param
    grads and the loss (whose mean divides by real rows only, docs/math.md §8.5) equal the unpadded pack."""
    layer = layer_for(variant)
    lengths = [17, 9, 26]
    width = layer.config.hidden_size
    segments, grad_segments = random_segments(lengths, width), random_segments(lengths, width)
    unpadded = pack(segments)
    padded = pack(segments, pads=[5, 3, 6])
    plain = run_packed(layer, unpadded, grad_segments)
    run = run_packed(layer, padded, grad_segments)
    for b in range(len(lengths)):
        assert_close(padded.split(run.out)[b], unpadded.split(plain.out)[b], f"output of segment {b}")
        assert_close(padded.split(run.grad_in)[b], unpadded.split(plain.grad_in)[b],
                     f"input grad of segment {b}")
    assert_filler_rows_zero(padded, run)
    assert_grads_close(run.grads, plain.grads, "param grads")
    assert_loss_matches(run.loss, plain.loss)


@pytest.mark.parametrize("pads", [[2, 1, 0], None], ids=["padded", "unpadded"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nan_tail_beyond_last_segment_is_inert(variant, pads):
    """A NaN-filled static-capacity tail (A5.5), with or without per-segment padding metadata:
    everything finite and equal to the run without the tail. (Round-off tolerance only: the tail
    changes tensor shapes, and with them possibly the BLAS blocking, but not the math.)"""
    layer = layer_for(variant)
    lengths = [19, 0, 11]
    width = layer.config.hidden_size
    segments, grad_segments = random_segments(lengths, width), random_segments(lengths, width)
    without = pack(segments, pads)
    with_tail = pack(segments, pads, tail=37)
    base = run_packed(layer, without, grad_segments)
    run = run_packed(layer, with_tail, grad_segments)
    assert torch.isnan(with_tail.hidden[with_tail.tail]).all()
    assert_filler_rows_zero(with_tail, run)
    rows = slice(0, without.num_rows)
    assert_close(run.out[rows], base.out, "output")
    assert_close(run.grad_in[rows], base.grad_in, "input grad")
    assert_grads_close(run.grads, base.grads, "param grads")
    assert_loss_matches(run.loss, base.loss)


# ------------------------------------------------------------------------------ degenerate segments
@pytest.mark.parametrize("pads", [[0, 0], [2, 3]], ids=["max_seqlen_0", "padding_only"])
@pytest.mark.parametrize("variant", ONE_PER_KIND)
def test_pack_without_real_tokens(variant, pads):
    """Every segment empty (an all-padding microbatch in a static buffer), with a NaN tail: the
    layer runs, output and input grad are exactly zero, param grads are exactly zero, the indexer
    loss is 0. With no padding rows `max_seqlen_q` is 0, which validation accepts."""
    layer = layer_for(variant)
    empty = random_segments([0, 0], layer.config.hidden_size)
    packed = pack(empty, pads, tail=3)
    run = run_packed(layer, packed, empty)
    assert_filler_rows_zero(packed, run)
    for name, grad in run.grads.items():
        assert torch.equal(grad, torch.zeros_like(grad)), name
    if run.loss is not None:
        assert run.loss == 0



DEGENERATE_LENGTHS = [0, 5, 1, 129, 0, 3, 128, 4, 127, 0]  # {0, 1, 3, 4, 5, 127, 128, 129}
DEGENERATE_PADS = [1, 0, 2, 3, 0, 1, 0, 2, 1, 2]


@pytest.mark.parametrize("variant,ratio", [
    ("C-sparse-mean", 4), ("C-dense-per_token", 4), ("H", 128),
], ids=["C-r4-sparse-mean", "C-r4-dense-per_token", "H-r128"])
def test_degenerate_segment_lengths(variant, ratio):
    """Segments of length 0, 1, 3, 4, 5, 127, 128, 129 (below, at and above the ratio; A5.6),
    with padding and a NaN tail: packed == separate, every selection stays in its segment."""
    layer = layer_for(variant, dsa_indexer_topk=4, hca_compress_ratio=max(ratio, 8))
    assert layer.core_attention.ratio == ratio
    packed, run = check_packed_vs_separate(layer, DEGENERATE_LENGTHS, DEGENERATE_PADS, tail=5)
    assert run.missing_grads == [], "every parameter needs a (possibly zero) gradient"
    check_selection_in_own_segment(layer, packed, run)


@pytest.mark.parametrize("variant", ONE_PER_KIND)
def test_many_short_segments(variant):
    """Forty segments of 0..9 tokens with random padding and a NaN tail (A5.2, A5.6)."""
    rng = random.Random(7)
    lengths = [rng.randint(0, 9) for _ in range(40)]
    pads = [rng.choice([0, 0, 1, 2]) for _ in lengths]
    layer = layer_for(variant, hca_compress_ratio=8)
    packed, run = check_packed_vs_separate(layer, lengths, pads, tail=4)
    if hasattr(layer, "core_attention"):  # W / C / H: check the index rows too
        check_selection_in_own_segment(layer, packed, run)


@pytest.mark.parametrize("variant", ["C-sparse-mean", "H"])
def test_segments_shorter_than_ratio_give_zero_compressor_grads(variant):
    """No segment reaches the compression ratio: no compressed entry exists at all, the output is
    window-only, and the compressor / indexer parameters get exact-zero (not missing) grads."""
    layer = layer_for(variant, hca_compress_ratio=16)
    ratio = layer.core_attention.ratio
    lengths = [ratio - 1, 1, 0, 2]
    packed, run = check_packed_vs_separate(layer, lengths, pads=[1, 0, 2, 0], tail=3)
    assert run.missing_grads == []
    for name, grad in run.grads.items():
        if "compressor" in name or "indexer" in name:
            assert torch.equal(grad, torch.zeros_like(grad)), name
    if run.compressed is not None:
        assert (run.compressed == -1).all()


@pytest.mark.parametrize("variant", ["C-sparse-per_token", "H", "M"])
def test_generous_max_seqlen_changes_nothing(variant):
    """`max_seqlen_q` is only an upper bound (CUDA graphs fix it at capacity): giving T, or leaving
    it out, gives the same result as the exact longest segment."""
    layer = layer_for(variant)
    lengths, pads = [23, 6, 14], [1, 4, 0]
    width = layer.config.hidden_size
    segments, grad_segments = random_segments(lengths, width), random_segments(lengths, width)
    exact = pack(segments, pads, tail=3)
    runs = [run_packed(layer, exact, grad_segments)]
    for bound in (exact.num_rows, None):
        other = pack(segments, pads, tail=3, max_seqlen=bound)
        runs.append(run_packed(layer, other, grad_segments))
    for other in runs[1:]:
        assert_close(other.out, runs[0].out, "output")
        assert_close(other.grad_in, runs[0].grad_in, "input grad")
        assert_grads_close(other.grads, runs[0].grads, "param grads")
        assert_loss_matches(other.loss, runs[0].loss)


def test_mla_packed_with_qk_dim_unequal_v_dim_and_gqa():
    """A5.7: the dense MLA kind with qk head dim (40 + 8 rotary) != v head dim (32) and two KV
    groups for four query heads, packed with padding and a NaN tail == separate calls."""
    layer = make_layer("M", qk_head_dim=40, kv_lora_rank=16, num_query_groups=2)
    config = layer.config
    assert config.mla_qk_head_dim + config.qk_pos_emb_head_dim != config.v_head_dim
    assert config.mla_num_query_groups < config.num_attention_heads
    check_packed_vs_separate(layer, [13, 1, 30, 0, 8], pads=[2, 0, 3, 1, 0], tail=6)


# ------------------------------------------------------------------------------ top-k ownership
def check_selection_in_own_segment(layer, packed: Packed, run: Run) -> None:
    """A4.6: map every selected kv row of `last_selection` back to (segment, position / entry).

    Window rows of a real token t (position p in segment b) are exactly the real rows
    max(start_b, t − W + 1) … t. Compressed rows are `T + c`; c must belong to segment b's entries
    (C_b = floor(L_b / r) of them, laid out in segment order) with entry index j satisfying the
    ratio-causal rule (j + 1)·r ≤ p + 1; the count is min(top-k, floor((p + 1)/r), C_b) for the
    indexer (all of them for H / dense mode), without duplicates. Filler rows never reference the
    unused compressed capacity.
    """
    config = layer.config
    ratio, window = layer.core_attention.ratio, config.csa_window_size
    rows = packed.num_rows
    lengths = [r.stop - r.start for r in packed.real]
    entries = [length // ratio for length in lengths] if ratio else [0] * len(lengths)
    cu_entries = torch.tensor([0] + entries).cumsum(0)
    topk = config.dsa_indexer_topk if layer.core_attention.indexer is not None else None
    for b, real in enumerate(packed.real):
        for position, t in enumerate(range(real.start, real.stop)):
            w = run.window[t]
            expected_window = torch.arange(max(real.start, t - window + 1), t + 1)
            assert torch.equal(w[w >= 0], expected_window), f"window of row {t}"
            if run.compressed is None:
                continue
            selected = run.compressed[t]
            selected = selected[selected >= 0]
            assert (selected >= rows).all(), f"row {t} selected a token row as compressed"
            entry = selected - rows
            segment = torch.searchsorted(cu_entries, entry, right=True) - 1
            assert (segment == b).all(), f"row {t} of segment {b} selected entries of {segment}"
            j = entry - cu_entries[b]
            assert ((j + 1) * ratio <= position + 1).all(), f"row {t} selected a future entry"
            visible = min((position + 1) // ratio, entries[b])
            count = visible if topk is None else min(topk, visible)
            assert selected.numel() == count and selected.unique().numel() == count, f"row {t}"
    if run.compressed is not None:
        filler = run.compressed[packed.filler]
        assert ((filler == -1) | ((filler >= rows) & (filler < rows + cu_entries[-1]))).all()


@pytest.mark.parametrize("variant", ["C-sparse-mean", "C-dense-per_token"])
def test_packed_topk_equals_separate_topk(variant):
    """The top-k selected in a pack, mapped to (segment, entry), is the separate calls' top-k."""
    layer = layer_for(variant, dsa_indexer_topk=3)
    lengths, pads = [37, 0, 9, 26], [2, 3, 0, 1]
    width = layer.config.hidden_size
    segments, grad_segments = random_segments(lengths, width), random_segments(lengths, width)
    packed = pack(segments, pads, tail=5)
    run = run_packed(layer, packed, grad_segments)
    check_selection_in_own_segment(layer, packed, run)
    cu_entries = [0]
    for length in lengths:
        cu_entries.append(cu_entries[-1] + length // 4)
    for b, (real, separate) in enumerate(zip(packed.real, run_each(layer, segments, grad_segments))):
        if separate is None:
            continue
        local = separate.compressed  # rows L_b + j in the separate call
        mine = run.compressed[real]  # rows T + cu_entries[b] + j in the pack
        to_entry = lambda idx, offset: torch.where(idx >= 0, idx - offset, -1)
        width_k = min(local.shape[1], mine.shape[1])
        assert (mine[:, width_k:] == -1).all() and (local[:, width_k:] == -1).all()
        assert torch.equal(to_entry(mine[:, :width_k], packed.num_rows + cu_entries[b]),
                           to_entry(local[:, :width_k], lengths[b])), f"segment {b}"
