"""Triton selection rows in the CPU interpreter vs the torch op (`ops.indices.selection_rows`).

Run by `test_triton_selection.py::test_interpreted_kernels` in a child process with `TRITON_INTERPRET=1`
(see `triton_support.py`). Both copy and look up the same values, so the comparison is exact.
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels.selection import selection_rows
from megatron_dsa.ops import indices
from megatron_dsa.ops.layout import TokenLayout

from selection_cases import selection_case
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [slice(None), slice(0, 10), slice(9, 27)])
def test_matches_torch_op_exactly_on_packed_segments(dtype, rows):
    columns, scores, entries, window, offset = selection_case(rows, topk=3, window=5, dtype=dtype)
    got = selection_rows(columns, scores, entries, rows, window, offset)
    expected = indices.selection_rows(columns, scores, entries, rows, window, offset)
    for name, value in expected._asdict().items():
        assert getattr(got, name).dtype == value.dtype, name
        assert torch.equal(getattr(got, name), value), name


def test_wide_rows_loop_over_blocks(monkeypatch):
    """More picks and window slots than one block holds: the kernel steps through them."""
    from megatron_dsa.backends.triton_kernels import selection

    monkeypatch.setattr(selection, "MAX_BLOCK", 2)
    columns, scores, entries, window, offset = selection_case(slice(None), topk=5, window=3)
    got = selection_rows(columns, scores, entries, slice(None), window, offset)
    expected = indices.selection_rows(columns, scores, entries, slice(None), window, offset)
    for name, value in expected._asdict().items():
        assert torch.equal(getattr(got, name), value), name


def test_no_picks_keeps_the_window():
    """Sequences shorter than the ratio have no entries: zero picks, the index rows are the window."""
    layout = TokenLayout.packed(torch.tensor([0, 3, 5]), 5, torch.device("cpu"))
    entries = indices.visible_compressed_entries(layout.compressed(4))
    window = indices.window_indices(layout, 2)
    columns, scores = torch.empty(5, 0, dtype=torch.long), torch.empty(5, 0)
    got = selection_rows(columns, scores, entries, slice(None), window, 5)
    assert torch.equal(got.combined, window) and got.entry_rows.shape == (5, 0)
