"""Triton gated pooling in the CPU interpreter vs the unfused reference (`megatron_dsa.ops.compressor`).

Run by `test_triton_compressor.py::test_interpreted_kernels` in a child process with
`TRITON_INTERPRET=1` (see `triton_support.py`). Both sides compute the softmax and the weighted sum in
the same dtype (float32, or float64); only the order of additions differs (≤ 16 slots, ≤ 7 entries
into dape) and the online softmax's rescaling: float32 rtol 1e-5 / atol 1e-6, float64 1e-12 / 1e-12.
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels import compressor as triton_compressor
from megatron_dsa.ops import compressor as reference
from megatron_dsa.ops.layout import CompressedLayout, TokenLayout
from megatron_dsa.ops.rope import plain_inv_freq
from compressor_cases import compress_projected, cumulative, inputs, packed_layout, run

from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}
DC = {4: 24, 8: 16, 16: 32}  # 24: a channel count that is not a power of two (masked channels)


def _layouts(ratio):
    """uniform: 2 sequences of 3r + 1 tokens (a tail each). packed: a segment shorter than r, one of
    exactly 2r, one with a tail; physical padding after each and 3 rows past the last segment."""
    return {"uniform": TokenLayout.uniform(2, 3 * ratio + 1, torch.device("cpu")).compressed(ratio),
            "packed": packed_layout(ratio, real=[ratio - 1, 2 * ratio, 3 * ratio + 2],
                                    padded=[ratio + 1, 2 * ratio + 3, 3 * ratio + 2], tail_rows=3)}


def _assert_matches_reference(kv, gate, ape, layout):
    """Forward on real entries, zeros on unused capacity rows, and every input grad, with NaN upstream
    gradients on the unused rows (they must not leak: the reference sees zeros there)."""
    valid = layout.valid
    upstream = torch.randn(layout.capacity, kv.shape[1] // reference.channel_factor(layout.ratio), dtype=kv.dtype)
    before = [t.detach().clone() for t in (kv, gate, ape)]
    got, got_grads = run(triton_compressor.gated_pool, kv, gate, ape, layout,
                         upstream.masked_fill(~valid[:, None], float("nan")))
    expected, expected_grads = run(reference.gated_pool, kv, gate, ape, layout,
                                   upstream.masked_fill(~valid[:, None], 0.0))
    assert got.shape == expected.shape and got.dtype == kv.dtype
    torch.testing.assert_close(got[valid], expected[valid], **TOL[kv.dtype])
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
    for name, a, b in zip(("kv", "gate", "ape"), got_grads, expected_grads):
        assert a.dtype == b.dtype and torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **TOL[kv.dtype], msg=lambda m, name=name: f"grad {name}: {m}")
    for name, old, new in zip(("kv", "gate", "ape"), before, (kv, gate, ape)):
        assert torch.equal(old, new.detach()), f"{name} was modified"
    return got_grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ratio", [4, 8, 16])
@pytest.mark.parametrize("kind", ["uniform", "packed"])
def test_forward_and_grads_match_reference(dtype, ratio, kind):
    layout = _layouts(ratio)[kind]
    kv, gate, ape = inputs(layout.tokens.num_rows, DC[ratio], ratio, dtype)
    grad_kv, grad_gate, _ = _assert_matches_reference(kv, gate, ape, layout)
    if kind == "packed":
        assert int(layout.valid.sum()) < layout.capacity  # the case has unused capacity rows
        read = torch.zeros(layout.tokens.num_rows, dtype=torch.bool)
        for first in layout.group_first_rows[layout.valid]:
            read[first:first + ratio] = True
        assert torch.equal(grad_kv[~read], torch.zeros_like(grad_kv[~read]))  # padding, tails: exactly 0
        assert torch.equal(grad_gate[~read], torch.zeros_like(grad_gate[~read]))


@pytest.mark.parametrize("strides", ["one row stride", "two row strides"])
def test_strided_rows_match_reference(monkeypatch, strides):
    """kv and gate as column slices of wider rows, as the layer's stacked projection hands them over (one row
    stride for both), or of two tensors of different widths: read in place, same values and grads."""
    layout = _layouts(4)["packed"]
    kv, gate, ape = inputs(layout.tokens.num_rows, DC[4], 4)
    rows, width = kv.shape
    if strides == "one row stride":
        wide = torch.cat((kv, gate, torch.randn(rows, 3)), 1).detach().requires_grad_()
        kv, gate = wide[:, :width], wide[:, width:2 * width]
    else:
        kv = torch.cat((torch.randn(rows, 3), kv), 1).detach().requires_grad_()[:, 3:]
        gate = torch.cat((gate, torch.randn(rows, 5)), 1).detach().requires_grad_()[:, :width]
    assert not kv.is_contiguous() and not gate.is_contiguous()
    handed = []
    apply = triton_compressor.TritonGatedPool.apply
    monkeypatch.setattr(triton_compressor.TritonGatedPool, "apply",
                        lambda *args: handed.append((args[0].data_ptr(), args[1].data_ptr())) or apply(*args))
    _assert_matches_reference(kv, gate, ape, layout)
    assert handed == [(kv.data_ptr(), gate.data_ptr())], "kv or gate was copied"


@pytest.mark.parametrize("ratio", [4, 16])
def test_small_tiles_match_reference(monkeypatch, ratio):
    """Several entry blocks and channel blocks, and a ratio-16 sweep of 4 slot steps (the online
    softmax rescales across steps), with 2-entry tiles."""
    monkeypatch.setattr(triton_compressor, "TILE_ROWS", 8)
    monkeypatch.setattr(triton_compressor, "SLOTS_PER_TILE", 4)
    monkeypatch.setattr(triton_compressor, "BLOCK_CHANNELS", 8)
    layout = _layouts(ratio)["packed"]
    _assert_matches_reference(*inputs(layout.tokens.num_rows, DC[ratio], ratio, torch.float64), layout)


@pytest.mark.parametrize("ratio", [4, 16])
def test_one_entry_tiles_that_fill_the_gpu_match_reference(monkeypatch, ratio):
    """What a decode step's few entries get on a GPU: entry blocks halved down to one entry (one warp for ratio
    4, two for ratio 16) so that the grid fills the multiprocessors."""
    monkeypatch.setattr(triton_compressor, "_fill_programs", lambda device: 1 << 30)
    layout = _layouts(ratio)["packed"]
    _assert_matches_reference(*inputs(layout.tokens.num_rows, DC[ratio], ratio, torch.float64), layout)


def test_ape_of_a_wider_dtype_than_kv():
    """The layer keeps ape in float32 while kv and gate may be bfloat16; here float64 ape with float32
    kv: the softmax runs in float32 (kv's compute dtype), out comes in kv's dtype, ape's grad in ape's."""
    layout = _layouts(4)["packed"]
    kv, gate, ape = inputs(layout.tokens.num_rows, 16, 4, torch.float32, ape_dtype=torch.float64)
    got, (_, _, grad_ape) = run(triton_compressor.gated_pool, kv, gate, ape, layout, torch.ones(layout.capacity, 16))
    assert got.dtype == torch.float32 and grad_ape.dtype == torch.float64
    expected, (_, _, ref_ape) = run(reference.gated_pool, kv, gate, ape, layout,
                                    layout.valid[:, None].to(torch.float32).expand(-1, 16))
    torch.testing.assert_close(got[layout.valid], expected[layout.valid], **TOL[torch.float32])
    torch.testing.assert_close(grad_ape, ref_ape, **TOL[torch.float32])


def test_context_parallel_piece_starting_mid_sequence():
    """A piece holding positions 4..19 of a sequence (its first 4 rows a halo) that pools entries
    j = 2..4: the first owned entry is not the first of its sequence, so its previous group (the
    rows before its own) is read, and group_first_rows are shifted by the position offset."""
    tokens = TokenLayout(cu_seqlens=cumulative([16]), num_rows=16, max_seqlen=16,
                         position_offsets=torch.tensor([4]), halo_lengths=torch.tensor([4]))
    layout = CompressedLayout.owned(tokens, 4, first_entry=torch.tensor([2]), counts=torch.tensor([3]),
                                    capacity=4)
    assert layout.entry_index.tolist() == [2, 3, 4, 0] and layout.group_first_rows.tolist() == [4, 8, 12, 0]
    _assert_matches_reference(*inputs(16, 8, 4, torch.float64), layout)


def test_sequences_shorter_than_ratio_give_no_entries_and_zero_grads():
    layout = TokenLayout.uniform(2, 3, torch.device("cpu")).compressed(4)
    kv, gate, ape = inputs(6, 8, 4)
    out, grads = run(triton_compressor.gated_pool, kv, gate, ape, layout, torch.ones(0, 8))
    assert out.shape == (0, 8)
    for grad, leaf in zip(grads, (kv, gate, ape)):
        assert torch.equal(grad, torch.zeros_like(leaf))


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("ratio", [4, 8])
def test_compress_matches_reference(ratio, rotate):
    """The whole compressor with the Triton pooling vs `ops.compressor.compress`: value and the grads
    of x, wkv, wgate, ape and the norm weight (float64, the rest of the pipeline is shared code)."""
    layout = _layouts(ratio)["packed"]
    gen = torch.Generator().manual_seed(7)
    dc, hidden = 16, 5
    width = reference.channel_factor(ratio) * dc
    leaves = [torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
              for shape in ((layout.tokens.num_rows, hidden), (width, hidden), (width, hidden), (ratio, width), (dc,))]
    args = (1e-6, layout, plain_inv_freq(8, base=10000.0), rotate)
    upstream = torch.randn(layout.capacity, dc, dtype=torch.float64).masked_fill(~layout.valid[:, None], 0.0)
    got = compress_projected(triton_compressor.compress, leaves, args)
    expected = compress_projected(reference.compress, leaves, args)
    torch.testing.assert_close(got[layout.valid], expected[layout.valid], **TOL[torch.float64])
    for name, a, b in zip(("x", "wkv", "wgate", "ape", "norm"), torch.autograd.grad((got * upstream).sum(), leaves),
                          torch.autograd.grad((expected * upstream).sum(), leaves)):
        torch.testing.assert_close(a, b, **TOL[torch.float64], msg=lambda m, name=name: f"grad {name}: {m}")


REFUSED = {
    "odd width for coff 2": (lambda kv, gate, ape, lay: (kv[:, :15], gate[:, :15], ape[:, :15], lay),
                             ValueError, "shapes disagree"),
    "gate shape": (lambda kv, gate, ape, lay: (kv, gate[:, :8], ape, lay), ValueError, "shapes disagree"),
    "ape rows": (lambda kv, gate, ape, lay: (kv, gate, ape[:3], lay), ValueError, "shapes disagree"),
    "3-d kv": (lambda kv, gate, ape, lay: (kv[None], gate[None], ape, lay), ValueError, "shapes disagree"),
    "token rows": (lambda kv, gate, ape, lay: (kv[:-1], gate[:-1], ape, lay), ValueError,
                   "kv has 25 rows but the layout has 26"),
    "gate dtype": (lambda kv, gate, ape, lay: (kv, gate.double(), ape, lay), TypeError, "kv and gate of one dtype"),
    "integer kv": (lambda kv, gate, ape, lay: (kv.int(), gate.int(), ape, lay), TypeError, "kv and gate of one"),
    "integer ape": (lambda kv, gate, ape, lay: (kv, gate, ape.long(), lay), TypeError, "kv and gate of one"),
    "token layout": (lambda kv, gate, ape, lay: (kv, gate, ape, lay.tokens), TypeError,
                     "layout must be a CompressedLayout"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_invalid_inputs_are_refused(case):
    change, error, match = REFUSED[case]
    layout = _layouts(4)["uniform"]  # 26 token rows
    kv, gate, ape = (t.detach() for t in inputs(layout.tokens.num_rows, 8, 4))
    with pytest.raises(error, match=match):
        triton_compressor.gated_pool(*change(kv, gate, ape, layout))
