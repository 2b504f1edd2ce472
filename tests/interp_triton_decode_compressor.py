"""Triton decode compressor write in the CPU interpreter against the reference (`ops.decode_compressor`, fp32):
both compressor shapes (ratio 4 overlapping, K = 2r slots, coff 2; ratio 8, K = r, coff 1), with and without the
Hadamard transform, a bf16 and an e4m3 store, in one launch and split in two (`launches`); positions that start
a sequence (entry 0, whose previous group is masked), complete a group, sit inside one, and wrap the slot ring;
and decode steps of C and H layers whose compressors run the kernel against the same steps through the reference
op.

Not collected by the default suite: `test_triton_decode_compressor.py` runs this file in a child process under
the interpreter (`triton_support.run_interpreted` says why). Tolerance: the fp32 kernel and the fp32 reference
differ in summation order only (softmax, RMSNorm, Hadamard), atol/rtol 1e-5 on values of order 1; the slot rows
are copies and compare exactly.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa.backends import call_counts
from megatron_dsa.backends.triton_kernels import decode_compressor
from megatron_dsa.backends.triton_kernels.decode_compressor import decode_compress as triton_write
from megatron_dsa.ops.decode_compressor import decode_compress as reference_write
from megatron_dsa.ops.decode_compressor import pending_slots
from megatron_dsa.ops.fp8_linear import FP8_MAX
from megatron_dsa.ops.indexer import FP8_KEYS
from interp_triton_decode_attention import decode_twins
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")
TOL = dict(atol=1e-5, rtol=1e-5)
# Entry 0 from its first token, the token that completes entry 0, entry 1's first (ratio 4: the previous group is
# entry 0's), one deep in the cache (the slot ring has wrapped), the last position the store holds.
POSITIONS = [0, 3, 4, 29, 39]


def write_inputs(ratio: int, dc: int, rope_dims: int, fp8: bool = False, seed: int = 0) -> dict:
    """A cache of 5 sequences of up to 40 positions with random pending slots and stores (the write must leave
    every other store row alone), and the new tokens' rows at `POSITIONS`."""
    g = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    width, entries = coff * dc, -(-40 // ratio)
    store = torch.randn(5, entries, dc, generator=g)
    scales = None
    if fp8:
        store, scales = (store / FP8_MAX).to(FP8_KEYS), torch.rand(5, entries, generator=g) + 0.5
    return dict(state=torch.randn(5, pending_slots(ratio), 2 * width, generator=g),
                new_rows=torch.randn(5, 2 * width, generator=g), positions=torch.tensor(POSITIONS),
                ape=torch.randn(ratio, width, generator=g), norm_weight=torch.rand(dc, generator=g) + 0.5,
                eps=1e-6, inv_freq=1.0 / 40 ** (torch.arange(rope_dims // 2) / (rope_dims // 2)),
                store=store, scales=scales, counts=torch.full((5,), -7, dtype=torch.int32))


def run_both(inputs: dict, rotate: bool) -> tuple[dict, dict]:
    """The buffers after the reference write and after the kernel's, from the same start."""
    results = []
    for write in (reference_write, triton_write):
        buffers = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        write(**buffers, rotate=rotate)
        results.append(buffers)
    return results[0], results[1]


@pytest.fixture(params=["one_launch", "split"])
def launches(request, monkeypatch):
    """Both forms of the kernel's write: one program per sequence, and pooling over (sequence, channel block)
    programs then a finishing launch (what a long group takes; forced here for every ratio, 4 pairs a block)."""
    if request.param == "split":
        monkeypatch.setattr(decode_compressor, "MAX_ONE_LAUNCH_RATIO", 1)
        monkeypatch.setattr(decode_compressor, "SPLIT_PAIRS", 4)
    return request.param


@pytest.mark.parametrize("ratio, dc, rope_dims", [(4, 32, 8), (8, 32, 8), (16, 32, 8), (4, 16, 16)],
                         ids=["ratio4_dc32", "ratio8_dc32", "ratio16_dc32", "ratio4_dc16_all_rotated"])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "hadamard"])
def test_write_matches_the_reference(ratio, dc, rope_dims, rotate, launches):
    expected, got = run_both(write_inputs(ratio, dc, rope_dims), rotate)
    assert torch.equal(got["state"], expected["state"])  # the new rows, where the reference put them
    torch.testing.assert_close(got["store"], expected["store"], **TOL)
    untouched = torch.ones(expected["store"].shape[:2], dtype=torch.bool)
    untouched[torch.arange(5), torch.tensor(POSITIONS) // ratio] = False
    inputs = write_inputs(ratio, dc, rope_dims)
    assert torch.equal(got["store"][untouched], inputs["store"][untouched])
    visible = (torch.tensor(POSITIONS, dtype=torch.int32) + 1) // ratio
    assert torch.equal(got["counts"], visible) and torch.equal(expected["counts"], visible)


@pytest.mark.parametrize("ratio", [4, 8])
def test_an_fp8_store_gets_the_reference_codes_and_scales(ratio, launches):
    """e4m3 codes and a float32 scale per entry (an FP8 indexer cache, Hadamard on). Scales to fp32 rounding; a
    code may land one e4m3 step away where the two sums straddle a rounding boundary (e4m3 steps are 2⁻³ of the
    value at most, plus the subnormal step 2⁻⁹ of the scale)."""
    expected, got = run_both(write_inputs(ratio, 32, 8, fp8=True), rotate=True)
    assert torch.equal(got["state"], expected["state"])
    torch.testing.assert_close(got["scales"], expected["scales"], **TOL)
    rows = torch.arange(5), torch.tensor(POSITIONS) // ratio
    values = [b["store"][rows].float() * b["scales"][rows].unsqueeze(-1) for b in (expected, got)]
    step = values[0].abs() * 2 ** -3 + expected["scales"][rows].unsqueeze(-1) * 2 ** -9
    assert ((values[1] - values[0]).abs() <= step).all()
    assert (got["store"][rows].view(torch.uint8) == expected["store"][rows].view(torch.uint8)).float().mean() > 0.95


def test_bad_buffers_are_refused_by_name():
    inputs = write_inputs(4, 32, 8)
    with pytest.raises(ValueError, match="writes state in place: it must be contiguous"):
        triton_write(**{**inputs, "state": inputs["state"].transpose(0, 1).contiguous().transpose(0, 1)},
                     rotate=False)
    with pytest.raises(ValueError, match="Hadamard transform takes power-of-two head dims"):
        bad = write_inputs(4, 24, 8)
        triton_write(**bad, rotate=True)
    with pytest.raises(ValueError, match="new_rows must be"):
        triton_write(**{**inputs, "new_rows": inputs["new_rows"][:, :-2]}, rotate=False)
    with pytest.raises(ValueError, match="counts must be a contiguous int32/int64"):
        triton_write(**{**inputs, "counts": inputs["counts"].float()}, rotate=False)


@pytest.mark.parametrize("kind", ["C", "H"])
@torch.no_grad()
def test_decode_steps_with_the_triton_compressor_write_match_the_reference_decode(kind, launches):
    """Prefill (reference path) then one token at a time through a layer whose compressors write through the
    kernel (counted), against the same steps through the reference op: the same picks every step, outputs and
    cached entries to fp32 rounding."""
    (expected, expected_picks, expected_cache), (got, picks, cache) = decode_twins(kind, "decode_compressor")
    assert call_counts()[("triton", "decode_compressor")] == 24 * (2 if kind == "C" else 1)
    if kind == "C":
        assert torch.equal(picks, expected_picks) and (picks >= 0).any()
        torch.testing.assert_close(cache.indexer_keys, expected_cache.indexer_keys, **TOL)
    torch.testing.assert_close(cache.entries, expected_cache.entries, **TOL)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
