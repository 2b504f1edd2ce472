"""Triton partial RoPE vs the unfused reference (`megatron_dsa.ops.rope.rope`).

CPU: the kernel runs in the Triton interpreter in a child process (`interp_triton_rope.py`; see
`triton_support.py` for why). GPU: dsv4 dims (T=4096, H=64, Dh=512, P=64), float32 and bfloat16.
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels import rope as triton_rope
from megatron_dsa.ops.rope import rope as reference_rope, yarn_inv_freq
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)


def test_interpreted_kernels():
    run_interpreted("interp_triton_rope.py")


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="cannot run on x's device"):
        triton_rope.rope(torch.randn(4, 16), torch.arange(4), torch.ones(4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dsv4_dims_on_gpu(dtype):
    """Against the reference run in the same dtype: the kernel repeats its rounding steps (cos/sin in
    float32 rounded to x's dtype, products, sum). It is not bitwise equal: Triton contracts
    `a·cos − b·sin` into an FMA (one rounding fewer) and its cosf/sinf may differ from torch's in the
    last ulp; on an H200 about 3% of the elements differed (fp32 and bf16). Each difference must stay
    within four ulps of the largest product (≤ 1.3·max|input|; ulp 2^-7 relative for bf16, 2^-23 for
    float32): an FMA saves one rounding per product pair, a last-ulp cos/sin change costs one more.
    Against float32 (for bf16 input): the bf16 rounding of cos/sin, products and sum, cosine > 0.9999.
    """
    pytest.importorskip("triton")
    torch.manual_seed(0)
    x = torch.randn(4096, 64, 512, device="cuda", dtype=dtype, requires_grad=True)
    positions = torch.arange(4096, device="cuda") * 4  # compressed entries sit at j·r
    inv_freq = yarn_inv_freq(64, base=10000.0, scaling_factor=16.0, original_max_position=65536)
    upstream = torch.randn_like(x)
    for inverse, amplitude in ((False, 1.0), (True, 0.8)):
        got = triton_rope.rope(x, positions, inv_freq, inverse=inverse, amplitude=amplitude)
        expected = reference_rope(x, positions, inv_freq, inverse=inverse, amplitude=amplitude)
        grad_got, = torch.autograd.grad(got, x, upstream)
        grad_expected, = torch.autograd.grad(expected, x, upstream)
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
        for what, a, b, source in (("out", got, expected, x), ("grad", grad_got, grad_expected, upstream)):
            bound = 4 * ulp * 1.3 * source.detach().abs().max().float()
            assert (a - b).abs().float().max() <= bound, f"{what}: a difference above four ulps"
        assert torch.equal(got[..., :448], x.detach()[..., :448])
        reference32 = reference_rope(x.detach().float(), positions, inv_freq, inverse=inverse, amplitude=amplitude)
        cos = torch.nn.functional.cosine_similarity(got.float().flatten(), reference32.flatten(), dim=0)
        assert cos > 0.9999, f"vs float32: cosine {cos}"
