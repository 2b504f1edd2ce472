"""Triton top-k and top-k ordering in the CPU interpreter vs their torch forms (`ops.indices.topk_columns`,
`backends.cudnn._in_reference_order`).

Run by `test_triton_topk_order.py::test_interpreted_kernels` in a child process with
`TRITON_INTERPRET=1` (see `triton_support.py`). Both sides pick the same columns in the same order, so
the comparisons are exact.
"""

import pytest
import torch

from megatron_dsa.backends.cudnn import _in_reference_order
from megatron_dsa.backends.triton_kernels.topk_order import order_picks, select_top_columns, topk
from megatron_dsa.ops.indices import topk_columns

from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")


def _case(rows: int, cols: int, width: int, seed: int = 0):
    """Scores with many ties, ±0.0 and −inf; picks in random order with −1, out-of-range ids and picks
    of invalid columns mixed in."""
    gen = torch.Generator().manual_seed(seed)
    ranked = torch.randint(-3, 4, (rows, cols + 3), generator=gen).float()  # padded wider than valid
    ranked[ranked == 0] = torch.tensor([-0.0, 0.0])[torch.randint(0, 2, (int((ranked == 0).sum()),), generator=gen)]
    ranked[:, 1] = float("-inf")
    valid = torch.rand(rows, cols, generator=gen) < 0.8
    picked = torch.stack([torch.randperm(cols, generator=gen)[:width] for _ in range(rows)])
    noise = torch.rand(rows, width, generator=gen)
    picked = torch.where(noise < 0.1, -1, torch.where(noise > 0.95, cols + 2, picked))
    return picked, ranked, valid


@pytest.mark.parametrize("rows,cols,width", [(5, 16, 16), (7, 40, 9), (3, 70, 33), (2, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_matches_torch_ordering_exactly(rows, cols, width, dtype):
    picked, ranked, valid = _case(rows, cols, width)
    got = order_picks(picked.to(dtype), ranked, valid)
    assert got.dtype == torch.long and got.shape == (rows, width)
    assert torch.equal(got, _in_reference_order(picked.long(), ranked, valid))


def test_rows_without_valid_picks_are_all_minus_one():
    picked, ranked, _ = _case(4, 12, 6)
    got = order_picks(picked, ranked, torch.zeros(4, 12, dtype=torch.bool))
    assert torch.equal(got, torch.full((4, 6), -1))


def _scores(rows: int, cols: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Finite scores with many exact ties (±0.0 among them) and a valid mask with empty rows, full rows
    and rows with fewer valid columns than k."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (rows, cols), generator=gen).to(dtype) / 2
    zeros = scores == 0
    scores[zeros] = torch.tensor([-0.0, 0.0], dtype=dtype)[torch.randint(0, 2, (int(zeros.sum()),), generator=gen)]
    valid = torch.rand(rows, cols, generator=gen) < 0.7
    valid[0] = False
    if rows > 1:
        valid[1] = True
    if rows > 2:
        valid[2, 2:] = False
    return scores, valid


@pytest.mark.parametrize("rows,cols,k", [(6, 16, 5), (5, 40, 40), (4, 70, 100), (3, 1, 1), (4, 33, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_matches_topk_columns_exactly(rows, cols, k, dtype):
    scores, valid = _scores(rows, cols, seed=rows * cols, dtype=dtype)
    got = topk(scores, valid, k)
    assert got.dtype == torch.long and got.shape == (rows, min(k, cols))
    assert torch.equal(got, topk_columns(scores, valid, k))


@pytest.mark.parametrize("cols", [40, 70])  # sorted whole, and selected first (`AUTO_MAX_COLUMNS` lowered below)
def test_topk_ranks_valid_columns_scoring_minus_inf_before_invalid_ones(cols, monkeypatch):
    """Valid columns scoring −inf, the invalid columns not a prefix: they are picked before any −1, as the
    reference ranks them (which a −inf fill of the invalid columns alone would not)."""
    from megatron_dsa.backends.triton_kernels import topk_order

    monkeypatch.setattr(topk_order, "AUTO_MAX_COLUMNS", 48)
    scores, valid = _scores(6, cols, seed=cols)
    scores[torch.rand(6, cols, generator=torch.Generator().manual_seed(cols)) < 0.4] = float("-inf")
    for k in (5, 33):
        assert torch.equal(topk(scores, valid, k), topk_columns(scores, valid, k)), k


def test_topk_of_strided_scores():
    """Scores as a column slice of a wider buffer (the layer's row chunks are contiguous, callers may not be)."""
    scores, valid = _scores(5, 48, seed=3)
    got = topk(scores[:, :40], valid[:, :40], 12)
    assert torch.equal(got, topk_columns(scores[:, :40], valid[:, :40], 12))


def _in_column_order(columns: torch.Tensor) -> torch.Tensor:
    """A top-k's picks as a set: ascending, −1 after them."""
    big = torch.iinfo(torch.long).max
    ordered = torch.where(columns >= 0, columns, big).sort(dim=1).values
    return torch.where(ordered == big, -1, ordered)


@pytest.mark.parametrize("rows,cols,k", [(6, 40, 5), (5, 70, 33), (4, 37, 37), (3, 50, 1), (5, 100, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_picks_the_top_k_set_with_the_lower_tied_columns(rows, cols, k, dtype):
    """Scores of seven values (about 14 columns per value at 100 columns): the k-th best score is tied in most
    rows, and the lower tied columns must win; ±0.0 tie; an empty row, a full row, a row with fewer valid
    columns than k."""
    scores, valid = _scores(rows, cols, seed=rows + cols + k, dtype=dtype)
    got = select_top_columns(scores, valid, k)
    assert got.dtype == torch.long and got.shape == (rows, k)
    assert torch.equal(got, _in_column_order(topk_columns(scores, valid, k)))


@pytest.mark.parametrize("programs", [2, 3, 7])
@pytest.mark.parametrize("rows,cols,k", [(6, 100, 20), (5, 70, 33), (3, 50, 1), (4, 64, 64)])
def test_select_split_over_several_programs_per_row_matches(programs, rows, cols, k):
    """Each row's columns split into chunks, one program each (the tickets and histograms in memory): the same
    set as the reference, the tied columns at the threshold spread over chunks, the lower ones winning."""
    scores, valid = _scores(rows, cols, seed=programs + rows + cols + k)
    got = select_top_columns(scores, valid, k, programs_per_row=programs)
    assert torch.equal(got, _in_column_order(topk_columns(scores, valid, k)))


@pytest.mark.parametrize("programs", [1, 4])
def test_select_reads_counts_for_a_prefix_of_valid_columns(programs):
    """A decode step's rows: no mask, the valid columns `[0, counts[t])` (none, fewer than k, all, some)."""
    scores, _ = _scores(5, 90, seed=11)
    counts = torch.tensor([0, 7, 90, 41, 63])
    valid = torch.arange(90) < counts.unsqueeze(1)
    got = select_top_columns(scores, None, 16, counts=counts, programs_per_row=programs)
    assert torch.equal(got, _in_column_order(topk_columns(scores, valid, 16)))


def test_select_leaves_its_workspace_zeroed_for_the_next_call():
    """The kernels zero the histograms and tickets they used (a CUDA graph replays them without a reset)."""
    from megatron_dsa.backends.triton_kernels import topk_order

    scores, valid = _scores(6, 100, seed=3)
    for _ in range(2):  # a second call finds them zero, else its counts would be off
        got = select_top_columns(scores, valid, 20, programs_per_row=5)
        assert torch.equal(got, _in_column_order(topk_columns(scores, valid, 20)))
    hist, tickets = topk_order._select_workspace(scores.device)
    assert not hist.any() and not tickets.any()


def test_select_of_one_score_everywhere_takes_the_first_columns():
    """Every column tied: the threshold is that score and the k lowest columns win (the tie rank crosses steps)."""
    scores, valid = torch.full((2, 45), 0.25), torch.ones(2, 45, dtype=torch.bool)
    valid[1, :3] = False
    got = select_top_columns(scores, valid, 20)
    assert torch.equal(got, torch.stack([torch.arange(20), torch.arange(3, 23)]))


def test_select_orders_negative_and_positive_scores_and_close_values():
    """Keys differing only in the low bits of the float, negatives below positives, a huge and a tiny value."""
    base = torch.tensor([1.0, 1.0000001, -1.0, -1.0000001, 3e38, -3e38, 1e-38, -1e-38, 0.0, -0.0, 2.0, 2.0])
    scores = base[torch.randperm(12, generator=torch.Generator().manual_seed(0))].repeat(3, 3)
    valid = torch.ones_like(scores, dtype=torch.bool)
    for k in (1, 5, 17, 36):
        assert torch.equal(select_top_columns(scores, valid, k), _in_column_order(topk_columns(scores, valid, k)))


def test_wide_rows_take_the_select_path_and_match_topk_columns_exactly(monkeypatch):
    """Above AUTO_MAX_COLUMNS the top-k selects then sorts: the reference order, ties to the lower column (the
    limit lowered to 32 columns: the interpreter's sort of a thousand picks takes half a minute)."""
    from megatron_dsa.backends.triton_kernels import topk_order

    monkeypatch.setattr(topk_order, "AUTO_MAX_COLUMNS", 32)
    monkeypatch.setattr(topk_order, "select_top_columns", counted := _Counted(topk_order.select_top_columns))
    scores, valid = _scores(4, 70, seed=5)
    valid[3] = torch.arange(70) < 45  # a decode row: a prefix of valid columns
    for k in (16, 50):
        assert torch.equal(topk(scores, valid, k), topk_columns(scores, valid, k))
    assert counted.calls == 2


def test_wide_rows_unordered_are_the_selection_in_column_order(monkeypatch):
    """`ordered=False` (a decode step's picks, read as a set): the select's columns as they are, without the sort."""
    from megatron_dsa.backends.triton_kernels import topk_order

    monkeypatch.setattr(topk_order, "AUTO_MAX_COLUMNS", 32)
    monkeypatch.setattr(topk_order, "order_picks", lambda *args: pytest.fail("an unordered top-k sorted its picks"))
    scores, valid = _scores(4, 70, seed=6)
    valid[3] = torch.arange(70) < 9  # fewer valid columns than k
    for k in (16, 50):
        assert torch.equal(topk(scores, valid, k, ordered=False), _in_column_order(topk_columns(scores, valid, k)))



def test_counts_stand_for_an_absent_valid_mask():
    """A decode step passes its entry counts and no mask: the same picks as the prefix mask gives."""
    scores, _ = _scores(4, 40, seed=7)
    counts = torch.tensor([0, 9, 40, 23])
    valid = torch.arange(40) < counts.unsqueeze(1)
    for ordered in (True, False):
        assert torch.equal(topk(scores, None, 12, counts=counts, ordered=ordered),
                           topk(scores, valid, 12, counts=counts, ordered=ordered))

class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)
