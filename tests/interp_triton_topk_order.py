"""Triton top-k ordering in the CPU interpreter vs its torch form (`backends.cudnn._in_reference_order`).

Run by `test_triton_topk_order.py::test_interpreted_kernels` in a child process with
`TRITON_INTERPRET=1` (see `triton_support.py`). Both put the same picks in the same order, so the
comparison is exact.
"""

import pytest
import torch

from megatron_dsa.backends.cudnn import _in_reference_order
from megatron_dsa.backends.triton_kernels.topk_order import order_picks

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
