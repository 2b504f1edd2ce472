"""Triton selection rows (`backends.triton_kernels.selection`): the picks' scores, buffer rows, kv_full
rows and the attention's index rows in one kernel, against the torch op (`ops.indices.selection_rows`).

CPU: the kernel runs in the Triton interpreter in a child process (`interp_triton_selection.py`); the
torch op itself is checked against the definitions here. GPU: dsv4-flash shapes, exactly.
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels.selection import selection_rows
from megatron_dsa.ops import indices
from megatron_dsa.ops.layout import TokenLayout
from selection_cases import selection_case
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)


def test_interpreted_kernels():
    run_interpreted("interp_triton_selection.py")


@pytest.mark.parametrize("rows", [slice(None), slice(9, 27)])
def test_torch_op_follows_its_definition(rows):
    columns, scores, entries, window, offset = selection_case(rows, topk=3, window=5)
    got = indices.selection_rows(columns, scores, entries, rows, window, offset)
    group = entries.group[rows]
    for r in range(columns.shape[0]):
        for slot, column in enumerate(columns[r].tolist()):
            if column < 0:
                assert got.entry_scores[r, slot] == float("-inf") and got.entry_rows[r, slot] == -1
                assert got.compressed[r, slot] == -1
            else:
                assert got.entry_scores[r, slot] == scores[r, column]
                assert got.entry_rows[r, slot] == entries.table[group[r], column]
                assert got.compressed[r, slot] == got.entry_rows[r, slot] + offset
    assert torch.equal(got.combined, torch.cat((window, got.compressed), 1))


def test_bad_inputs_name_the_rule():
    columns, scores, entries, window, offset = selection_case(slice(None), topk=3, window=5)
    with pytest.raises(ValueError, match="window \\[n, W\\]"):
        selection_rows(columns, scores, entries, slice(None), window[:-1], offset)
    with pytest.raises(ValueError, match="picks per row"):
        selection_rows(torch.zeros(27, 9, dtype=torch.long), scores, entries, slice(None), window, offset)
    with pytest.raises(TypeError, match="int64 columns"):
        selection_rows(columns.int(), scores, entries, slice(None), window, offset)
    with pytest.raises(TypeError, match="scores must be"):
        selection_rows(columns, scores.long(), entries, slice(None), window, offset)


def test_cpu_without_interpreter_is_refused(without_interpreter):
    columns, scores, entries, window, offset = selection_case(slice(None), topk=3, window=5)
    with pytest.raises(ValueError, match="cannot run on columns' device"):
        selection_rows(columns, scores, entries, slice(None), window, offset)


@pytest.mark.gpu
def test_gpu_matches_torch_op_at_dsv4_shapes():
    """4096 tokens in one sequence at ratio 4 (1024 entries), top-512, window 128, and a chunk of rows."""
    pytest.importorskip("triton")
    layout = TokenLayout.uniform(1, 4096, torch.device("cuda"))
    entries = indices.visible_compressed_entries(layout.compressed(4))
    window = indices.window_indices(layout, 128)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (slice(None), slice(1000, 3000)):
        candidates = entries.rows(rows)
        scores = torch.where(candidates >= 0, torch.randn(candidates.shape, device="cuda", generator=gen), float("-inf"))
        columns = indices.topk_columns(scores, candidates >= 0, 512)
        got = selection_rows(columns, scores, entries, rows, window[rows], layout.num_rows)
        expected = indices.selection_rows(columns, scores, entries, rows, window[rows], layout.num_rows)
        for name, value in expected._asdict().items():
            assert torch.equal(getattr(got, name), value), name
