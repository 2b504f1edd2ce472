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
