"""Row layouts and index tables (docs/math.md §5, §6.3, §11; bug classes A3.5, A4.1, A4.3, A4.4).

Everything here is integer-valued, so every comparison is exact (tier T0, `==` / `torch.equal`).
"""

import pytest
import torch

from megatron_dsa.ops import indices
from megatron_dsa.ops.indices import (UniformVisibleRows, offset_valid, row_range, topk_columns,
                                      visible_compressed_entries, visible_compressed_indices, window_indices)
from megatron_dsa.ops.layout import TokenLayout
from oracles import (INVALID, compressed_counts_oracle, segment_starts, topk_oracle, visible_compressed_oracle,
                     window_rows_oracle)

CPU = torch.device("cpu")
PACKS = [[7], [5, 1, 9, 3], [4, 0, 6, 2]]  # the last one has an empty segment


def packed(lengths) -> TokenLayout:
    """A multi-segment layout built from cu_seqlens directly."""
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.long)
    return TokenLayout(cu_seqlens=cu, num_rows=sum(lengths), max_seqlen=max(lengths))


def _pad(rows, width):
    return [row + [INVALID] * (width - len(row)) for row in rows]


def test_uniform_layout_is_batch_major():
    layout = TokenLayout.uniform(3, 4, CPU)
    assert layout.cu_seqlens.tolist() == [0, 4, 8, 12]
    assert layout.num_rows == 12 and layout.num_segments == 3 and layout.max_seqlen == 4
    assert layout.segment_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert layout.positions.tolist() == [0, 1, 2, 3] * 3


@pytest.mark.parametrize("lengths", PACKS)
def test_packed_layout_positions_restart_per_segment(lengths):
    layout = packed(lengths)
    expected_pos = [p for length in lengths for p in range(length)]
    expected_seg = [b for b, length in enumerate(lengths) for _ in range(length)]
    assert layout.positions.tolist() == expected_pos
    assert layout.segment_ids.tolist() == expected_seg


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("lengths", PACKS)
def test_window_rows_match_oracle(lengths, window):
    got = window_indices(packed(lengths), window)
    assert got.shape == (sum(lengths), window)
    assert got.tolist() == window_rows_oracle(lengths, window)


@pytest.mark.parametrize("window", [1, 4, 16])
def test_window_rows_uniform_never_future_never_cross_segment(window):
    batch, seqlen = 2, 10
    layout = TokenLayout.uniform(batch, seqlen, CPU)
    got = window_indices(layout, window)
    assert got.tolist() == window_rows_oracle([seqlen] * batch, window)
    t = torch.arange(batch * seqlen).unsqueeze(1)
    valid = got >= 0
    assert torch.all(got[valid] <= t.expand_as(got)[valid])  # never future
    assert torch.all((got // seqlen)[valid] == (t // seqlen).expand_as(got)[valid])  # own segment
    # −1 only as a suffix: once invalid, stays invalid along the row
    assert torch.all(valid[:, 1:] <= valid[:, :-1])
    # row t holds min(W, p+1) entries and always includes itself
    counts = valid.sum(1)
    assert counts.tolist() == [min(window, p + 1) for p in layout.positions.tolist()]
    assert torch.all((got == t).any(1))


def _visibility_lengths(ratio):
    """Lengths < r, == r, multiples and non-multiples of r (and a length-1 segment)."""
    return [ratio - 1, ratio, 2 * ratio, 2 * ratio + 3, 1, 3 * ratio - 1]


@pytest.mark.parametrize("ratio", [4, 8, 16, 128])
def test_ratio_causal_visibility_brute_force(ratio):
    lengths = _visibility_lengths(ratio)
    clayout = packed(lengths).compressed(ratio)
    got = visible_compressed_indices(clayout)
    assert got.shape == (sum(lengths), max(lengths) // ratio)
    assert got.tolist() == _pad(visible_compressed_oracle(lengths, ratio), got.shape[1])
    assert clayout.visible_counts().tolist() == [len(r) for r in visible_compressed_oracle(lengths, ratio)]


@pytest.mark.parametrize("ratio", [4, 8, 16, 128])
def test_compressed_layout_counts_and_groups(ratio):
    lengths = _visibility_lengths(ratio)
    clayout = packed(lengths).compressed(ratio)
    counts = compressed_counts_oracle(lengths, ratio)
    assert clayout.cu_compressed.tolist() == [sum(counts[:i]) for i in range(len(counts) + 1)]
    assert clayout.capacity >= sum(counts) and clayout.max_entries == max(lengths) // ratio
    real = int(clayout.valid.sum())
    assert real == sum(counts) and clayout.valid[:real].all()
    entry = [j for c in counts for j in range(c)]
    assert clayout.entry_index[:real].tolist() == entry
    assert clayout.positions[:real].tolist() == [j * ratio for j in entry]
    firsts = [start + j * ratio for start, c in zip(segment_starts(lengths), counts) for j in range(c)]
    assert clayout.group_first_rows[:real].tolist() == firsts


@pytest.mark.parametrize("ratio", [4, 128])
def test_tail_tokens_are_never_compressed(ratio):
    """Every compressed group lies inside its segment; tokens after the last full group are in none."""
    lengths = _visibility_lengths(ratio)
    clayout = packed(lengths).compressed(ratio)
    real = int(clayout.valid.sum())
    covered = set()
    for first in clayout.group_first_rows[:real].tolist():
        covered.update(range(first, first + ratio))
    expected = {start + p for start, length in zip(segment_starts(lengths), lengths)
                for p in range(length // ratio * ratio)}
    assert covered == expected


@pytest.mark.parametrize("ratio", [4, 128])
def test_short_sequences_have_no_compressed_entries(ratio):
    layout = TokenLayout.uniform(2, ratio - 1, CPU)
    clayout = layout.compressed(ratio)
    assert clayout.cu_compressed.tolist() == [0, 0, 0]
    assert int(clayout.valid.sum()) == 0
    visible = visible_compressed_indices(clayout)
    assert visible.shape[0] == layout.num_rows and torch.all(visible == INVALID)


def test_compressed_layout_rejects_ratio_below_two():
    with pytest.raises(ValueError):
        TokenLayout.uniform(1, 8, CPU).compressed(1)


def test_padded_packed_layout_uses_real_lengths():
    """Per-segment padding (THD, docs/math.md §11): real lengths [5, 9, 3] stored at multiples of 4. Only real
    tokens are compressed, real rows see exactly the unpadded visibility and windows, and no row
    (padding included) sees more entries than its segment has."""
    real, padded = [5, 9, 3], [8, 12, 4]
    cu = torch.tensor([0, 5, 14, 17])
    cu_padded = torch.tensor([0, 8, 20, 24])
    layout = TokenLayout.packed(cu, 24, CPU, cu_seqlens_padded=cu_padded, max_seqlen=12)
    physical = [start + p for start, length in zip(segment_starts(padded), real) for p in range(length)]
    assert layout.row_valid.nonzero().flatten().tolist() == physical
    clayout = layout.compressed(4)
    counts = compressed_counts_oracle(real, 4)
    assert clayout.cu_compressed.tolist() == [0, 1, 3, 3]
    assert clayout.group_first_rows[:sum(counts)].tolist() == [0, 8, 12]
    visible = visible_compressed_indices(clayout)
    expected_visible = _pad(visible_compressed_oracle(real, 4), visible.shape[1])
    assert visible[physical].tolist() == expected_visible
    seg_counts = torch.tensor(counts)[layout.segment_ids]
    assert torch.all(clayout.visible_counts() <= seg_counts)
    to_physical = {logical: row for logical, row in enumerate(physical)}
    expected_window = [[to_physical.get(r, INVALID) if r >= 0 else INVALID for r in row]
                       for row in window_rows_oracle(real, 3)]
    assert window_indices(layout, 3)[physical].tolist() == expected_window


# ----------------------------------------------------------------------------- top-k columns

def _brute_topk(scores, valid, k):
    return topk_oracle(scores.tolist(), valid.tolist(), k)


def test_topk_pads_with_minus_one_when_fewer_valid_than_k():
    scores = torch.tensor([[0.5, 2.0, -1.0, 3.0, 0.0],
                           [9.0, 8.0, 7.0, 6.0, 5.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, False, False, False],
                          [False] * 5,
                          [True, False, True, False, True]])
    got = topk_columns(scores, valid, 3)
    assert got.dtype == torch.int64
    assert got.tolist() == [[1, 0, -1], [-1, -1, -1], [0, 2, 4]] == _brute_topk(scores, valid, 3)


@pytest.mark.parametrize("k", [1, 4, 5, 6, 50])
def test_topk_k_at_or_above_candidate_count(k):
    """A4.1: k > candidates never raises; width min(k, C); valid count min(k, n_valid)."""
    scores = torch.randn(7, 5, dtype=torch.float64)
    valid = torch.rand(7, 5) < 0.6
    got = topk_columns(scores, valid, k)
    assert got.shape == (7, min(k, 5))
    assert got.tolist() == _brute_topk(scores, valid, k)
    assert (got >= 0).sum(1).tolist() == [min(k, int(v)) for v in valid.sum(1)]


def test_topk_ranks_a_valid_column_scoring_minus_inf_before_every_invalid_one():
    """A valid −inf score ties with the masked columns in the score sort; it is still a valid column, picked
    before any −1 (as the Triton and cuDNN orders rank it), wherever the invalid columns sit."""
    inf = float("inf")
    scores = torch.tensor([[0.0, -inf, 1.0], [-inf, 5.0, -inf]])
    valid = torch.tensor([[False, True, True], [True, False, True]])
    assert topk_columns(scores, valid, 2).tolist() == [[2, 1], [0, 2]]
    gen = torch.Generator().manual_seed(11)
    scores = torch.randint(-2, 3, (40, 12), generator=gen).float()
    scores[torch.rand(40, 12, generator=gen) < 0.3] = -inf
    valid = torch.rand(40, 12, generator=gen) < 0.6
    for k in (1, 4, 12):
        assert topk_columns(scores, valid, k).tolist() == _brute_topk(scores, valid, k), k


def test_topk_of_prefix_masks_is_the_same_with_the_uniform_rows_hint():
    """The hint (valid is a prefix of each row) skips the validity sort: the result must not change."""
    gen = torch.Generator().manual_seed(12)
    scores = torch.randint(-2, 3, (16, 10), generator=gen).float()
    scores[torch.rand(16, 10, generator=gen) < 0.3] = float("-inf")
    counts = torch.randint(0, 11, (16, 1), generator=gen)
    valid = torch.arange(10) < counts
    hint = UniformVisibleRows(seqlen=40, entries=10, ratio=4, start=0, stop=16)
    for k in (3, 10):
        expected = _brute_topk(scores, valid, k)
        assert topk_columns(scores, valid, k).tolist() == expected
        assert topk_columns(scores, valid, k, hint).tolist() == expected



def test_topk_counts_stand_for_an_absent_valid_mask():
    """`valid=None` with `counts` (a decode step's call): the prefixes `[0, counts[t])`; with neither, a clear error."""
    gen = torch.Generator().manual_seed(13)
    scores = torch.randn(6, 10, generator=gen)
    counts = torch.tensor([0, 3, 10, 7, 1, 5])
    valid = torch.arange(10) < counts.unsqueeze(1)
    assert torch.equal(topk_columns(scores, None, 4, counts=counts), topk_columns(scores, valid, 4))
    with pytest.raises(ValueError, match="needs a valid mask, or counts"):
        topk_columns(scores, None, 4)

def test_topk_with_zero_candidates():
    got = topk_columns(torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool), 4)
    assert got.shape == (3, 0)


def test_topk_relu_degenerate_ties_prefer_lower_columns_and_are_deterministic():
    """A4.3: 100 distinct winners and 8220 exact zeros, topk 2048 (sglang #30645 shape)."""
    width, k, winners = 8320, 2048, 100
    gen = torch.Generator().manual_seed(7)
    scores = torch.zeros(1, width, dtype=torch.float64)
    winner_cols = torch.randperm(width, generator=gen)[:winners]
    scores[0, winner_cols] = torch.rand(winners, generator=gen, dtype=torch.float64) + 0.5
    valid = torch.ones(1, width, dtype=torch.bool)
    runs = [topk_columns(scores, valid, k) for _ in range(5)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    got = runs[0][0].tolist()
    assert INVALID not in got and len(set(got)) == k
    ordered_winners = sorted(winner_cols.tolist(), key=lambda c: -float(scores[0, c]))
    assert got[:winners] == ordered_winners
    lowest_zero_cols = [c for c in range(width) if c not in set(winner_cols.tolist())][:k - winners]
    assert got[winners:] == lowest_zero_cols
    assert runs[0].tolist() == _brute_topk(scores, valid, k)


def test_topk_all_equal_row_takes_lowest_columns():
    scores = torch.full((2, 9), 0.25, dtype=torch.float64)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False
    got = topk_columns(scores, valid, 4)
    assert got.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6]]


def test_topk_ranks_float64_scores_at_full_precision():
    """Scores that differ only below float32 resolution must still be ranked by their real value:
    column 1 (1 + 1e-12) beats column 0 (1.0); a tie-break to the lower column is wrong here."""
    scores = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64)
    valid = torch.ones(1, 3, dtype=torch.bool)
    assert _brute_topk(scores, valid, 1) == [[1]]
    assert topk_columns(scores, valid, 1).tolist() == [[1]]


# ----------------------------------------------------------------------------- sentinel helpers

def test_offset_valid_keeps_invalid_invalid():
    """A4.4: adding a batch/segment offset must not turn −1 into a valid row."""
    ids = torch.tensor([[-1, 0, 5], [3, -1, -1]])
    assert offset_valid(ids, 100).tolist() == [[-1, 100, 105], [103, -1, -1]]
    assert offset_valid(ids, 1).tolist() == [[-1, 1, 6], [4, -1, -1]]  # −1 + 1 would be 0




def test_uniform_layouts_and_what_is_derived_from_them_are_shared_per_shape():
    device = torch.device("cpu")
    first = TokenLayout.uniform(2, 24, device)
    assert TokenLayout.uniform(2, 24, device) is first
    assert TokenLayout.uniform(3, 24, device) is not first
    assert first.compressed(4) is first.compressed(4) and first.compressed(4) is not first.compressed(8)
    built = []
    window = first.derived(("window", 3), lambda: built.append(1) or window_indices(first, 3))
    assert first.derived(("window", 3), lambda: built.append(1)) is window and built == [1]
    torch.testing.assert_close(window, window_indices(TokenLayout.packed(first.cu_seqlens, 48, device), 3))


def test_all_visible_rows_are_kept_when_small_and_equal_the_chunked_rows(monkeypatch: pytest.MonkeyPatch):
    """The full id matrix is built once and reused (a shared layout's); chunks and large matrices are
    built per call; every form holds the same ids."""
    layout = TokenLayout.packed(torch.tensor([0, 17, 40]), 40, torch.device("cpu")).compressed(4)
    entries = visible_compressed_entries(layout)
    whole = entries.rows()
    assert entries.rows(slice(0, 40)) is whole and entries.rows(slice(None)) is whole
    chunked = torch.cat([entries.rows(chunk) for chunk in entries.row_chunks(7 * entries.width)])
    assert torch.equal(chunked, whole)
    assert entries.rows(slice(3, 9)) is not entries.rows(slice(3, 9))
    # The valid-column mask is kept with the rows, else computed from the rows given.
    assert entries.valid(slice(None), whole) is entries.valid(slice(0, 40), whole)
    assert torch.equal(entries.valid(slice(None), whole), whole >= 0)
    part = entries.rows(slice(3, 9))
    assert torch.equal(entries.valid(slice(3, 9), part), part >= 0)
    monkeypatch.setattr(indices, "KEPT_ROWS_ELEMENTS", whole.numel() - 1)
    fresh = visible_compressed_entries(layout)
    assert fresh.rows() is not fresh.rows() and torch.equal(fresh.rows(), whole)
    assert fresh.valid(slice(None), whole) is not fresh.valid(slice(None), whole)
    assert torch.equal(fresh.valid(slice(None), whole), whole >= 0)


def test_row_range_agrees_with_slice_indices() -> None:
    """The traceable stand-in for `slice.indices` gives its bounds for every step-1 slice, empty ones
    included (then `start == stop`), and refuses other steps by name."""
    bounds = (None, -9, -3, -1, 0, 1, 3, 7, 8, 20)
    for rows in (0, 1, 7):
        for start in bounds:
            for stop in bounds:
                chunk = slice(start, stop)
                first, last, _ = chunk.indices(rows)
                assert row_range(chunk, rows) == (first, max(first, last)), (chunk, rows)
    with pytest.raises(ValueError, match="step-1 slices, got step 2"):
        row_range(slice(0, 4, 2), 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk_of_gpu_score_dtypes_is_the_oracle_order(dtype):
    """The GPU's score dtypes (the other tests use float64): exact ties (±0.0 among them), valid −inf
    scores and masked columns come out in the oracle's order, at every k."""
    gen = torch.Generator().manual_seed(13)
    for _ in range(20):
        scores = (torch.randint(-3, 4, (12, 37), generator=gen) * 0.5).to(dtype)
        scores[torch.rand(12, 37, generator=gen) < 0.2] = float("-inf")
        scores[torch.rand(12, 37, generator=gen) < 0.1] = -0.0
        valid = torch.rand(12, 37, generator=gen) < 0.7
        for k in (1, 5, 37, 50):
            assert topk_columns(scores, valid, k).tolist() == _brute_topk(scores.double(), valid, k), k


@pytest.mark.parametrize("cp_size, halo", [(1, 0), (2, 5), (3, 7)])
def test_prefix_counts_are_each_rows_valid_prefix(cp_size, halo):
    """`VisibleEntries.prefix_counts` (the `topk` family's `counts` hint a layer passes): row t's valid columns are
    exactly `[0, counts[t])`, for a padded packed pack on one device and for every CP rank's extended rows."""
    from megatron_dsa.layers.context_parallel import ContextParallelRows
    from megatron_dsa.parallel.context import ContextParallelPlan

    ratio, lengths, real = 4, (24, 36, 12), (21, 36, 5)
    if cp_size == 1:
        cu_padded = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        cu = torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()])
        layout = TokenLayout.packed(cu, sum(lengths), CPU, cu_seqlens_padded=cu_padded, max_seqlen=max(lengths))
        every_rank = [indices.visible_compressed_entries(layout.compressed(ratio))]
    else:
        plan = ContextParallelPlan.build(lengths, cp_size, "zigzag", real)
        every_rank = [ContextParallelRows(plan, rank, None, halo, torch.device("cpu")).visible_entries(ratio)
                      for rank in range(cp_size)]
    for entries in every_rank:
        rows = entries.rows()
        counts = entries.prefix_counts(slice(None))
        prefix = torch.arange(entries.width) < counts.unsqueeze(1)
        assert torch.equal(entries.valid(slice(None), rows), prefix)
        assert torch.equal(entries.prefix_counts(slice(2, 9)), counts[2:9])
