"""The Triton FP8 attention-row writer in the CPU interpreter against `ops.paged_rows.write_decode_rows`: dsv4's
rows (7 tiles of 64) and a tiny model's (one tile of 24), magnitudes from 1e-8 to 1e8, zero tiles, strided rows,
bf16 and fp32 input, ring and entry slots: the pages byte for byte; and W / C / H decode steps with FP8 attention
rows whose writes run the kernel against the same steps through the reference.

Not collected by the default suite: `test_paged_rows.py::test_interpreter_cases` runs this file in a child process
under the interpreter (`triton_support.run_interpreted` says why).
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa.backends import call_counts
from megatron_dsa.backends.triton_kernels.paged_rows import write_decode_rows as triton_write
from megatron_dsa.ops.paged_rows import PagedRows, write_decode_rows
from interp_triton_decode_attention import decode_twins
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.mark.parametrize("dim, rope", [(512, 64), (32, 8)], ids=["dsv4", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots, ratio", [(7, 1), (9, 4)], ids=["ring", "entries"])
def test_kernel_writes_the_references_bytes(dim, rope, dtype, slots, ratio):
    g = torch.Generator().manual_seed(0)
    batch = 5
    rows = (torch.randn(dim, batch, generator=g) * torch.logspace(-8, 8, batch)).to(dtype).t()  # strided rows
    rows[1, :dim - rope] = 0  # zero tiles
    rows[2, 3] = -rows[2, 3].abs() * 1e3  # a tile whose amax is negative
    positions = torch.tensor([0, 5, 11, 30, 35])
    expected, got = PagedRows.empty(batch, slots, dim, rope), PagedRows.empty(batch, slots, dim, rope)
    write_decode_rows(expected.pages, slots, dim, rope, rows.contiguous(), positions, ratio)
    triton_write(got.pages, slots, dim, rope, rows, positions, ratio)
    assert torch.equal(got.pages, expected.pages), (got.pages != expected.pages).nonzero()[:8]


@pytest.mark.parametrize("kind", ["W", "C", "H"])
def test_decode_steps_with_the_kernel_match_the_reference_decode(kind):
    (expected, _, expected_cache), (got, _, cache) = decode_twins(kind, "paged_rows_write", tokens=20,
                                                                   fp8_attention_rows=True)
    writes = 2 if kind in "CH" else 1  # the window row, and the compressor's entry
    assert call_counts().get(("triton", "paged_rows_write"), 0) == 14 * writes, call_counts()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for name in ("window", "entries"):
        a, b = getattr(expected_cache, name), getattr(cache, name)
        assert (a is None and b is None) or torch.equal(a.pages, b.pages), name


# ------------------------------------------------------------------------------ decode attention over the pages
@pytest.mark.parametrize("kind", ["W", "C", "H"])
@pytest.mark.parametrize("dim, rope, parts, splits", [(512, 64, 1, 1), (512, 64, 1, 3), (512, 64, 2, 3),
                                                      (48, 16, 1, 1), (48, 16, 1, 3)],
                         ids=["dsv4_one_split", "dsv4_three_splits", "dsv4_two_parts", "tail_one_split",
                              "tail_three_splits"])
def test_paged_decode_attention_matches_the_reference(kind, dim, rope, parts, splits):
    """The Triton decode kernels reading FP8 pages (fp32 queries: the interpreter's bf16 dots are not bf16's) against
    the reference on the same pages, with the inverse RoPE in the combine or after a single split: the window of W
    slots holding the new row (positions before, at and past the window), kind C's picks (−1, repeated, not yet
    visible), kind H's visible entries; dsv4's 7 tiles of 64 and a row whose 32 e4m3 columns are one tile (no value
    parts there: 48 is no power of two)."""
    from megatron_dsa.backends.triton_kernels.decode_attention import DecodeTiles, paged_decode_attention
    from megatron_dsa.ops.decode_attention import paged_decode_attention as reference
    from megatron_dsa.ops.paged_rows import write_rows

    g = torch.Generator().manual_seed(0)
    batch, heads, window, slots = 4, 6, 16, 40
    seqlens = torch.tensor([0, 9, 100, 159])

    def pages(count):
        paged = PagedRows.empty(batch, count, dim, rope)
        write_rows(paged, torch.arange(batch).repeat_interleave(count), torch.arange(count).repeat(batch),
                   torch.randn(batch * count, dim, generator=g))
        return paged

    query = torch.randn(batch, heads, dim, generator=g) * 0.3
    entries = None if kind == "W" else pages(slots)
    ids = None
    if kind == "C":
        ids = torch.randint(0, slots, (batch, 12), generator=g)
        ids[:, 0] = -1
        ids[3, 4] = ids[3, 5]
    freq = 1.0 / (10000 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    args = (query, pages(window), seqlens, window, entries, ids, 4, torch.linspace(-2, 2, heads), dim ** -0.5, freq)
    want = reference(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() == 3 else a
                       for a in args])
    got = paged_decode_attention(*args, splits=splits, tiles=DecodeTiles(16, 4, 2, parts))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("kind", ["W", "C", "H"])
def test_decode_steps_reading_pages_with_the_kernel_match_the_reference_decode(kind):
    (expected, _, _), (got, _, _) = decode_twins(kind, "paged_decode_attention", tokens=20, fp8_attention_rows=True)
    assert call_counts().get(("triton", "paged_decode_attention"), 0) == 14, call_counts()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
