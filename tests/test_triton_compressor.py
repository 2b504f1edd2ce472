"""Triton gated pooling of the compressor vs the unfused reference (`megatron_dsa.ops.compressor`).

CPU: the kernel runs in the Triton interpreter in a child process (`interp_triton_compressor.py`; see
`triton_support.py` for why). GPU: dsv4 dims (T=4096; ratio 4 and 128 at Dc=512, the indexer's ratio
4 at Dc=128), float32 and bfloat16 inputs vs the reference in float32.
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels import compressor as triton_compressor
from megatron_dsa.ops import compressor as reference
from megatron_dsa.ops.rope import plain_inv_freq
from compressor_cases import compress_projected, inputs, packed_layout, run
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)

# T = 4096 rows: a short packed batch with tails (1001 = 4·250 + 1, 2051 = 128·16 + 3) and padding.
GPU_REAL, GPU_PADDED = [1001, 2051, 1040], [1003, 2051, 1042]


def test_interpreted_kernels():
    run_interpreted("interp_triton_compressor.py")


def test_cpu_without_interpreter_is_refused(without_interpreter):
    layout = packed_layout(4, real=[8])
    with pytest.raises(ValueError, match="cannot run on kv's device"):
        triton_compressor.gated_pool(*inputs(8, 16, 4), layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,dc", [(4, 512), (128, 512), (4, 128)])
def test_dsv4_dims_on_gpu(dtype, ratio, dc):
    """kv, gate in `dtype`, ape float32 (as the layer keeps it), vs the reference in float32 on the same
    (dtype-rounded) inputs and upstream gradient. Both compute the softmax and the sums in float32;
    the kernel's exp (ex2-based) and its order of additions differ by a few float32 ulps: float32
    rtol/atol 1e-5. bfloat16: out, dkv and dgate are those float32 values rounded once to bf16 (half
    an ulp, 2^-9 relative): rtol 2^-8. dape is summed over ≤ 1024 entries in float32 in both (order
    only): rtol/atol 1e-4. The backward uses no atomics, so a second run is bitwise equal.
    """
    pytest.importorskip("triton")
    layout = packed_layout(ratio, GPU_REAL, GPU_PADDED, device="cuda")
    kv, gate, ape = inputs(sum(GPU_PADDED), dc, ratio, dtype, ape_dtype=torch.float32, device="cuda")
    upstream = torch.randn(layout.capacity, dc, device="cuda").to(dtype).masked_fill(~layout.valid[:, None], 0)
    got, got_grads = run(triton_compressor.gated_pool, kv, gate, ape, layout, upstream)
    ref_inputs = [t.detach().float().requires_grad_() for t in (kv, gate, ape)]
    expected, expected_grads = run(reference.gated_pool, *ref_inputs, layout, upstream.float())
    tol = dict(rtol=2.0 ** -8, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    valid = layout.valid
    torch.testing.assert_close(got[valid].float(), expected[valid], **tol)
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
    for name, a, b in zip(("kv", "gate", "ape"), got_grads, expected_grads):
        assert torch.isfinite(a).all(), name
        bound = dict(rtol=1e-4, atol=1e-4) if name == "ape" else tol
        torch.testing.assert_close(a.float(), b, **bound, msg=lambda m, name=name: f"grad {name}: {m}")
    _, again = run(triton_compressor.gated_pool, kv, gate, ape, layout, upstream)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, again)), "backward is not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,dc,rotate", [(4, 512, False), (128, 512, False), (4, 128, True)])
def test_compress_on_gpu(ratio, dc, rotate):
    """The whole compressor (hidden 256) with the Triton pooling vs `ops.compressor.compress`, float32:
    the pooling differs by a few ulps (above), which RMSNorm, RoPE and the Hadamard carry linearly:
    rtol/atol 1e-4 for the value and the grads of x, wkv, wgate, ape and the norm weight."""
    pytest.importorskip("triton")
    layout = packed_layout(ratio, GPU_REAL, GPU_PADDED, device="cuda")
    gen = torch.Generator().manual_seed(3)
    width, hidden = reference.channel_factor(ratio) * dc, 256
    shapes = ((sum(GPU_PADDED), hidden), (width, hidden), (width, hidden), (ratio, width), (dc,))
    scales = (1.0, hidden ** -0.5, hidden ** -0.5, 0.5, 1.0)
    leaves = [(torch.randn(*shape, generator=gen) * scale).cuda().requires_grad_()
              for shape, scale in zip(shapes, scales)]
    args = (1e-6, layout, plain_inv_freq(64, base=10000.0).cuda(), rotate)
    upstream = torch.randn(layout.capacity, dc, device="cuda").masked_fill(~layout.valid[:, None], 0.0)
    got = compress_projected(triton_compressor.compress, leaves, args)
    expected = compress_projected(reference.compress, leaves, args)
    torch.testing.assert_close(got[layout.valid], expected[layout.valid], rtol=1e-4, atol=1e-4)
    for name, a, b in zip(("x", "wkv", "wgate", "ape", "norm"), torch.autograd.grad((got * upstream).sum(), leaves),
                          torch.autograd.grad((expected * upstream).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"grad {name}: {m}")
