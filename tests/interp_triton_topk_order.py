"""Triton top-k and top-k ordering in the CPU interpreter vs their torch forms (`ops.indices.topk_columns`,
`backends.cudnn._in_reference_order`).

Run by `test_triton_topk_order.py::test_interpreted_kernels` in a child process with
`TRITON_INTERPRET=1` (see `triton_support.py`). Both sides pick the same columns in the same order, so
the comparisons are exact.
"""

import pytest
import torch

from megatron_dsa.backends.cudnn import _in_reference_order
from megatron_dsa.backends.triton_kernels.topk_order import order_picks, topk
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


def test_topk_of_strided_scores():
    """Scores as a column slice of a wider buffer (the layer's row chunks are contiguous, callers may not be)."""
    scores, valid = _scores(5, 48, seed=3)
    got = topk(scores[:, :40], valid[:, :40], 12)
    assert torch.equal(got, topk_columns(scores[:, :40], valid[:, :40], 12))
