"""Packed-sequence metadata validation (bug class A5.1 and the rules of `megatron_dsa.packed_seq`).

Each rule is checked through the layer (what a user sees) with a message naming the field and the
rule. Then the Fast-LLM case: a `cu_seqlens_kv` that does not start at 0 is refused with a pointer
to `canonicalize_cu_seqlens`, which narrows K/V (views, no copy) so the layer accepts it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_dsa.packed_seq import PackedSeqParams, canonicalize_cu_seqlens, validate_packed_seq_params
from test_packed_support import (
    assert_close, assert_loss_matches, make_layer, pack, random_segments, run_layer,
)


@pytest.fixture(scope="module")
def layer():
    return make_layer("C")


def good_pack(layer, lengths=(6, 0, 9), pads=(2, 1, 0), tail=3):
    return pack(random_segments(lengths, layer.config.hidden_size), list(pads), tail)


def call(layer, hidden, params):
    return layer(hidden, packed_seq_params=params)


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


def test_well_formed_pack_is_accepted(layer):
    packed = good_pack(layer)
    validate_packed_seq_params(packed.params, packed.num_rows)
    out, _ = call(layer, packed.hidden, packed.params)
    assert out.shape == packed.hidden.shape


def test_int64_cu_seqlens_rejected(layer):
    packed = good_pack(layer)
    params = dataclasses.replace(packed.params, cu_seqlens_q=packed.params.cu_seqlens_q.long())
    with pytest.raises(TypeError, match=r"cu_seqlens_q.*int32"):
        call(layer, packed.hidden, params)


def test_two_dim_cu_seqlens_rejected(layer):
    packed = good_pack(layer)
    params = dataclasses.replace(packed.params, cu_seqlens_q=packed.params.cu_seqlens_q.view(1, -1))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be 1-D"):
        call(layer, packed.hidden, params)


def test_single_entry_cu_seqlens_rejected(layer):
    packed = good_pack(layer)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be 1-D with nseg \+ 1 >= 2"):
        call(layer, packed.hidden, PackedSeqParams(cu_seqlens_q=int32([0])))


def test_decreasing_cu_seqlens_rejected(layer):
    packed = good_pack(layer, pads=(0, 0, 0), tail=0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
        call(layer, packed.hidden, PackedSeqParams(cu_seqlens_q=int32([0, 9, 6, 15])))


def test_last_entry_beyond_rows_rejected(layer):
    packed = good_pack(layer, pads=(0, 0, 0), tail=0)
    rows = packed.num_rows
    with pytest.raises(ValueError, match=rf"cu_seqlens_q\[-1\] = {rows + 1} exceeds .* T = {rows}"):
        call(layer, packed.hidden, PackedSeqParams(cu_seqlens_q=int32([0, 6, rows + 1])))
    padded = dataclasses.replace(good_pack(layer).params, cu_seqlens_q_padded=int32([0, 8, 9, 99]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q_padded\[-1\] = 99 exceeds"):
        call(layer, good_pack(layer).hidden, padded)


def test_padded_shorter_than_unpadded_rejected(layer):
    packed = good_pack(layer)  # real [0, 6, 6, 15], padded [0, 8, 9, 18]
    params = dataclasses.replace(packed.params, cu_seqlens_q_padded=int32([0, 8, 9, 17]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q_padded.*segment 2 is shorter padded than"):
        call(layer, packed.hidden, params)


def test_max_seqlen_smaller_than_longest_segment_rejected(layer):
    packed = good_pack(layer)  # longest padded segment: 9 rows
    params = dataclasses.replace(packed.params, max_seqlen_q=8)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(8\) is smaller than the longest"):
        call(layer, packed.hidden, params)
    params = dataclasses.replace(packed.params, max_seqlen_q=9.0)
    with pytest.raises(TypeError, match=r"max_seqlen_q must be a non-negative host int"):
        call(layer, packed.hidden, params)


def test_batch_dimension_must_be_one(layer):
    packed = good_pack(layer)
    hidden = packed.hidden.expand(-1, 2, -1)
    with pytest.raises(ValueError, match=r"\[T, 1, hidden\]"):
        call(layer, hidden, packed.params)


def test_mismatched_boundary_tensors_rejected(layer):
    packed = good_pack(layer)
    other_kv = dataclasses.replace(packed.params, cu_seqlens_kv=int32([0, 6, 7, 15]))
    with pytest.raises(ValueError, match=r"cu_seqlens_kv must equal its cu_seqlens_q counterpart"):
        call(layer, packed.hidden, other_kv)
    fewer = dataclasses.replace(packed.params, cu_seqlens_q_padded=int32([0, 8, 18]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q_padded has 3 entries but cu_seqlens_q has 4"):
        call(layer, packed.hidden, fewer)
    wrong_format = dataclasses.replace(packed.params, qkv_format="sbhd")
    with pytest.raises(ValueError, match=r"qkv_format must be 'thd'"):
        call(layer, packed.hidden, wrong_format)


def test_kv_padded_without_q_padded_is_not_silently_ignored(layer):
    """Self-attention: the kv boundaries must equal the q boundaries. Without
    `cu_seqlens_q_padded` the physical q boundaries are `cu_seqlens_q`, so a `cu_seqlens_kv_padded`
    that differs from them (the pack really is padded) must be refused, not dropped: dropping it
    reads the NaN padding rows as real tokens."""
    packed = good_pack(layer)  # real [0, 6, 6, 15], padded [0, 8, 9, 18]
    params = PackedSeqParams(cu_seqlens_q=packed.params.cu_seqlens_q,
                             cu_seqlens_kv=packed.params.cu_seqlens_q,
                             cu_seqlens_kv_padded=packed.params.cu_seqlens_q_padded,
                             max_seqlen_q=packed.params.max_seqlen_q)
    with pytest.raises(ValueError, match=r"cu_seqlens_kv_padded"):
        call(layer, packed.hidden, params)


# ------------------------------------------------------------------------------ A5.1 (Fast-LLM #514)
GARBAGE = 4  # rows of a "past" K/V slot prepended to the pack


def test_non_canonical_cu_seqlens_kv_rejected_with_pointer(layer):
    """cu_seqlens_kv = [G, …] over a K/V buffer with G garbage rows in front: refused, naming the
    start-at-0 rule and the helper that fixes it (never silently mis-addressed)."""
    packed = good_pack(layer, pads=(0, 0, 0), tail=0)
    hidden = torch.cat((torch.full_like(packed.hidden[:GARBAGE], float("nan")), packed.hidden))
    shifted = packed.params.cu_seqlens_q + GARBAGE
    params = PackedSeqParams(cu_seqlens_q=shifted, cu_seqlens_kv=shifted)
    with pytest.raises(ValueError, match=r"must start at 0.*canonicalize_cu_seqlens") as error:
        call(layer, hidden, params)
    assert "cu_seqlens_q" in str(error.value)
    canonical_q = PackedSeqParams(cu_seqlens_q=packed.params.cu_seqlens_q, cu_seqlens_kv=shifted)
    with pytest.raises(ValueError, match=r"cu_seqlens_kv must start at 0.*canonicalize_cu_seqlens"):
        call(layer, packed.hidden, canonical_q)


def test_canonicalize_narrows_views_and_layer_accepts(layer):
    """canonicalize_cu_seqlens returns K/V views narrowed to the covered rows and offsets shifted
    to 0; the layer then matches the canonical run, and the garbage rows get exactly zero grad."""
    lengths = [6, 0, 9]
    width = layer.config.hidden_size
    segments, grads = random_segments(lengths, width), random_segments(lengths, width)
    packed = pack(segments)
    grad_out = packed.like(grads).unsqueeze(1)
    garbage = torch.full_like(packed.hidden[:GARBAGE], float("nan"))
    trailing = torch.full_like(packed.hidden[:3], float("nan"))
    buffer = torch.cat((garbage, packed.hidden, trailing)).requires_grad_()
    offset_cu = packed.params.cu_seqlens_q + GARBAGE

    key, value, cu = canonicalize_cu_seqlens(buffer, buffer, offset_cu)
    assert cu.tolist() == packed.params.cu_seqlens_q.tolist() and cu.dtype == torch.int32
    assert key.shape[0] == value.shape[0] == packed.num_rows
    for view in (key, value):
        assert view._base is buffer  # a view, no copy
        assert view.data_ptr() == buffer[GARBAGE].data_ptr()

    reference = run_layer(layer, packed.hidden, grad_out, packed.params)
    layer.zero_grad(set_to_none=True)
    out, _ = layer(key, packed_seq_params=PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu))
    out.backward(grad_out)
    assert_close(out.detach(), reference.out, "output")
    assert_close(buffer.grad[GARBAGE:GARBAGE + packed.num_rows], reference.grad_in, "input grad")
    outside = torch.cat((buffer.grad[:GARBAGE], buffer.grad[GARBAGE + packed.num_rows:]))
    assert torch.equal(outside, torch.zeros_like(outside))
    assert_loss_matches(layer.last_indexer_loss, reference.loss)


def test_canonicalize_rejects_offsets_outside_the_buffer():
    kv = torch.zeros(5, 2)
    with pytest.raises(ValueError, match=r"outside key/value"):
        canonicalize_cu_seqlens(kv, kv, int32([2, 4, 7]))
