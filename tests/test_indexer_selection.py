"""Top-k selection in row chunks (never the whole `[T, C]` score matrix) equals one-shot selection,
and `VisibleEntries` reproduces the dense visible-entry matrix it replaces."""

from __future__ import annotations

import pytest
import torch

from megatron_dsa.layers import compressed_attention
from megatron_dsa.ops import indices
from megatron_dsa.ops.indices import INVALID, visible_compressed_entries
from megatron_dsa.ops.layout import TokenLayout
from test_layer_parity import inputs, make_config, make_layer, run_layer


@pytest.mark.parametrize("sparse_loss", [True, False])
def test_chunked_selection_equals_one_shot(monkeypatch, sparse_loss):
    config = make_config(dsa_indexer_use_sparse_loss=sparse_loss)
    layer = make_layer(config, "C")
    x, upstream = inputs(config)
    one_shot = run_layer(layer, x, upstream)
    picks, loss = layer.core_attention.last_selection.entries.clone(), layer.last_indexer_loss
    # 7 (row, column) pairs per chunk: one query row per chunk, and a final ragged chunk.
    monkeypatch.setattr(compressed_attention, "SELECTION_CHUNK_ELEMENTS", 7)
    chunked = run_layer(layer, x, upstream)
    assert torch.equal(layer.core_attention.last_selection.entries, picks)
    torch.testing.assert_close(layer.last_indexer_loss, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(chunked[0], one_shot[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked[1], one_shot[1], rtol=1e-12, atol=1e-12)
    for name, grad in one_shot[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-12, atol=1e-12, msg=name)


def test_visible_entries_rows_and_pick_match_brute_force():
    cu = torch.tensor([0, 9, 10, 27])  # segments of 9, 1 and 17 tokens
    layout = TokenLayout.packed(cu, 27, torch.device("cpu"))
    entries = visible_compressed_entries(layout.compressed(4))
    dense = entries.rows()
    first_entry = [0, 2, 2]  # 9 // 4 = 2 entries, then 0, then 4
    for t in range(27):
        seg = int(torch.searchsorted(cu, t, right=True)) - 1
        visible = min((t - int(cu[seg]) + 1) // 4, (int(cu[seg + 1] - cu[seg])) // 4)
        expected = [first_entry[seg] + j if j < visible else INVALID for j in range(dense.shape[1])]
        assert dense[t].tolist() == expected, t
    assert torch.equal(torch.cat([entries.rows(rows) for rows in entries.row_chunks(5)]), dense)
    columns = torch.tensor([[1, 0, -1, 3]]).expand(27, -1)
    picked = entries.pick(columns)
    valid = columns >= 0
    assert torch.equal(picked[valid], entries.table[entries.group.unsqueeze(1).expand(-1, 4)[valid],
                                                    columns[valid]])
    assert (picked[~valid] == INVALID).all()


def test_hca_index_rows_are_kept_with_a_shared_layout_while_small(monkeypatch):
    """H layers attend the window and every visible entry, which depend on the layout only: layers and
    steps sharing a uniform layout reuse one index matrix; above the size bound each forward builds its own,
    with the same rows and the same outputs and gradients."""
    config = make_config()
    first, second = make_layer(config, "H"), make_layer(config, "H", seed=1)
    x, upstream = inputs(config)
    kept = run_layer(first, x, upstream)
    rows = first.core_attention.last_selection.all()
    run_layer(second, x, upstream)
    assert second.core_attention.last_selection.all() is rows
    window = first.core_attention.last_selection.window
    compressed = first.core_attention.last_selection.compressed
    assert torch.equal(rows, torch.cat((window, compressed), 1))
    # Over the bound (the shared layout of the first shape keeps its rows: a fresh shape shows the rule).
    monkeypatch.setattr(indices, "KEPT_ROWS_ELEMENTS", 0)
    fresh_x, fresh_upstream = inputs(config, seqlen=x.shape[0] - 4)
    run_layer(first, fresh_x, fresh_upstream)
    built = first.core_attention.last_selection.all()
    run_layer(first, fresh_x, fresh_upstream)
    assert first.core_attention.last_selection.all() is not built
    assert torch.equal(first.core_attention.last_selection.all(), built)
    again = run_layer(first, x, upstream)  # the kept rows of the first shape serve as before
    for got, expected in zip(again[:2], kept[:2]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
