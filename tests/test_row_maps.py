"""`ops.row_maps.RowMap`: a fixed row selection whose gradient is gathered back, against `index_select`'s."""

import pytest
import torch

from megatron_dsa.ops.row_maps import RowMap


def gradients(x: torch.Tensor, take) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = take(x)
    out.backward(torch.arange(out.numel(), dtype=x.dtype).view_as(out) + 1)  # every output row's gradient differs
    return out.detach(), x.grad


@pytest.mark.parametrize("index, sources, free", [
    ([4, 0, 2], 6, ()),              # injective; rows 1, 3, 5 untaken
    ([5, 5, 0, 1, 5], 6, (5,)),      # a free (zero) row taken three times
    ([3, 2, 1, 0], 4, ()),           # a permutation
])
def test_take_equals_index_select_with_its_gradient(index, sources, free):
    rows = RowMap.build(torch.tensor(index), sources, torch.device("cpu"), free=free)
    assert rows.inverse is not None  # the gathered backward serves these
    x = torch.randn(sources, 3, 2, dtype=torch.float64)
    if free:
        x[list(free)] = 0  # what a free row is: a constant the caller needs no gradient of
    out, grad = gradients(x, rows.take)
    expected_out, expected_grad = gradients(x, lambda t: t.index_select(0, torch.tensor(index)))
    assert torch.equal(out, expected_out)
    expected_grad[list(free)] = 0
    assert torch.equal(grad, expected_grad)
    if not free:  # (a free row's gradient is dropped on purpose)
        assert torch.autograd.gradcheck(lambda t: rows.take(t)[:, :, :1], x.clone().requires_grad_())


def test_a_row_taken_twice_keeps_the_accumulating_backward():
    rows = RowMap.build(torch.tensor([1, 1, 0]), 3, torch.device("cpu"))
    assert rows.inverse is None
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(gradients(x, rows.take)[1], gradients(x, lambda t: t.index_select(0, rows.index))[1])


def test_empty_index_and_bad_index():
    rows = RowMap.build(torch.empty(0, dtype=torch.long), 3, torch.device("cpu"))
    x = torch.randn(3, 4, requires_grad=True)
    rows.take(x).sum().backward()
    assert torch.equal(x.grad, torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"row map index must lie in \[0, 3\)"):
        RowMap.build(torch.tensor([0, 3]), 3, torch.device("cpu"))


@pytest.mark.parametrize("cp_size, lengths, real, batch", [(2, (32, 32), None, 2), (2, (32, 24), (30, 24), None),
                                                           (4, (64,), None, 1)])
def test_cp_rows_take_the_gathered_backward(cp_size, lengths, real, batch):
    """A CP rank's fixed selections (halo tails, extended rows, piece outputs, entry slots) take each source row
    at most once apart from the zero row when every piece is at least a halo long, so all of them get the gathered
    backward, not `index_add_`'s. (Pieces shorter than the halo share halo rows: the extended rows then keep
    `index_select`'s backward, which the CP parity tests' ragged packs run.)"""
    from megatron_dsa.layers.context_parallel import ContextParallelRows
    from megatron_dsa.parallel.context import ContextParallelPlan

    plan = ContextParallelPlan.build(lengths, cp_size, "zigzag", real)
    for rank in range(cp_size):
        rows = ContextParallelRows(plan, rank, None, 5, torch.device("cpu"), batch=batch)
        for row_map in (rows._tail_rows, rows._extended_rows, rows._piece_rows, rows._slot_rows(4)):
            assert row_map.inverse is not None, (rank, row_map.index.tolist())
