"""Triton decode append (a decode step's last write) in the CPU interpreter against the reference
(`ops.decode_append`): a window ring whose slots wrap, a latent cache as wide as M's rows (576: two column blocks),
strided new rows, bf16 and fp32 (the writes are copies: bit for bit); and decode steps of W, C, H and M layers
whose last write runs the kernel against the same steps through the reference op.

Not collected by the default suite: `test_triton_decode_append.py` runs this file in a child process under the
interpreter (`triton_support.run_interpreted` says why).
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa.backends import call_counts
from megatron_dsa.backends.triton_kernels.decode_append import append_rows as triton_append
from megatron_dsa.ops.decode_append import append_rows as reference_append
from interp_triton_decode_attention import decode_twins
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.mark.parametrize("slots, width", [(4, 512), (40, 576), (1, 8)], ids=["window_ring", "latent_576", "one_slot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_as_the_reference(slots, width, dtype):
    g = torch.Generator().manual_seed(0)
    buffer = torch.randn(3, slots, width, generator=g).to(dtype)
    rows = torch.randn(width, 3, generator=g).to(dtype).t()  # strided rows
    seqlens = torch.tensor([0, 5, 39])
    expected_buffer, expected_lengths = buffer.clone(), seqlens.clone()
    reference_append(expected_buffer, rows.contiguous(), expected_lengths)
    triton_append(buffer, rows, seqlens)
    assert torch.equal(buffer, expected_buffer) and torch.equal(seqlens, expected_lengths)
    assert seqlens.tolist() == [1, 6, 40]


@pytest.mark.parametrize("kind", ["W", "C", "H", "M"])
def test_decode_steps_with_the_kernel_match_the_reference_decode(kind):
    (expected, _, expected_cache), (got, _, cache) = decode_twins(kind, "decode_append", tokens=20)
    assert call_counts().get(("triton", "decode_append"), 0) == 14, call_counts()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for name in ("seqlens", "window", "latent"):
        a, b = getattr(expected_cache, name), getattr(cache, name)
        assert (a is None and b is None) or torch.equal(a, b), name
