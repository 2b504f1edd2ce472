"""Triton RMSNorm + partial RoPE vs the unfused composition (`megatron_dsa.ops.rope.norm_rope`).

CPU: the kernels run in the Triton interpreter in a child process (`interp_triton_norm_rope.py`; see
`triton_support.py` for why). GPU: dsv4 query dims (T=4096, H=64, Dh=512, P=64), float32 and
bfloat16; the weighted compressor dims; a small float64 case; CUDA-graph capture.
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels import norm_rope as triton_norm_rope
from megatron_dsa.ops.rope import norm_rope as reference_norm_rope, yarn_inv_freq
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)

EPS = 1e-6


def test_interpreted_kernels():
    run_interpreted("interp_triton_norm_rope.py")


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="cannot run on x's device"):
        triton_norm_rope.norm_rope(torch.randn(4, 16), torch.arange(4), torch.ones(4), EPS)


def _query_case(dtype, tokens=4096, heads=64, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(tokens, heads, 512, device="cuda", dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens, device="cuda")
    inv_freq = yarn_inv_freq(64, base=10000.0, scaling_factor=16.0, original_max_position=65536).cuda()
    return x, positions, inv_freq


def _run(fn, x, positions, inv_freq, upstream):
    out = fn(x, positions, inv_freq, EPS)
    grad, = torch.autograd.grad(out, x, upstream)
    return out, grad


# Max difference allowed, in ulps of the largest reference value (see the test's docstring).
BOUND_ULPS = {torch.bfloat16: 8, torch.float32: 16}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dsv4_query_dims_on_gpu(dtype):
    """Against the unfused composition in the same dtype. The kernel repeats its rounding steps but is
    not bitwise equal:
    * its float32 rstd (another summation order, Triton's rsqrt) may differ from torch's by a few
      float32 ulps: n = x·rstd moves by as many float32 ulps or, in bf16, one rounding of n flips by
      one ulp; the rotation carries that into both members of a pair (|cos| + |sin| ≤ √2);
    * its cosf/sinf may differ from torch's in the last ulp (in bf16 a flip of the rounded cos/sin);
      in float32 Triton contracts `a·cos − b·sin` into an FMA (one rounding fewer; in bf16 the
      explicit roundings of the products prevent it);
    * the backward sums mean(∂n·x) in another order and rounds the gradient once.
    Worst case a few ulps; bound: 8 ulps of the largest value in bf16 (ulp 2^-7 relative), 16 in
    float32 (2^-23; the rstd difference is a few ulps itself). Against float32 (for bf16 input): the
    bf16 roundings, cosine > 0.9999.
    """
    pytest.importorskip("triton")
    x, positions, inv_freq = _query_case(dtype)
    upstream = torch.randn_like(x)
    got = _run(triton_norm_rope.norm_rope, x, positions, inv_freq, upstream)
    expected = _run(reference_norm_rope, x, positions, inv_freq, upstream)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
    for what, a, b in zip(("out", "grad"), got, expected):
        largest_ulp = ulp * b.abs().max().float()
        worst = ((a - b).abs().float().max() / largest_ulp).item()
        differing = (a != b).float().mean().item()
        print(f"{dtype} {what}: max difference {worst:.2f} ulps of the largest value, {differing:.2%} differ")
        assert worst <= BOUND_ULPS[dtype], f"{what}: {worst:.2f} ulps of the largest value"
    reference32 = reference_norm_rope(x.detach().float(), positions, inv_freq, EPS)
    cos = torch.nn.functional.cosine_similarity(got[0].float().flatten(), reference32.flatten(), dim=0)
    assert cos > 0.9999, f"vs float32: cosine {cos}"


@pytest.mark.gpu
@pytest.mark.parametrize("width", [512, 128])  # the attention's and the indexer's compressed entries
def test_weighted_compressor_dims_on_gpu(width):
    """The compressor's use: a bf16 weight on 1024 entries (dsv4-flash C at S = 4096), P = 64. out and dx
    as in the query test (8 ulps of the largest value); the weight gradient sums 1024 float32 products
    in another order than torch and is rounded once to bf16, like the reference: the same 8-ulp bound."""
    pytest.importorskip("triton")
    torch.manual_seed(3)
    x = torch.randn(1024, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (1 + 0.3 * torch.randn(width, device="cuda")).bfloat16().requires_grad_()
    positions = torch.arange(1024, device="cuda") * 4
    inv_freq = yarn_inv_freq(64, base=160000.0, scaling_factor=16.0, original_max_position=65536).cuda()
    upstream = torch.randn_like(x)
    results = []
    for fn in (triton_norm_rope.norm_rope, reference_norm_rope):
        out = fn(x, positions, inv_freq, EPS, weight)
        results.append((out, *torch.autograd.grad(out, (x, weight), upstream)))
    for what, a, b in zip(("out", "dx", "dweight"), *results):
        worst = ((a - b).abs().float().max() / (2.0 ** -7 * b.abs().max().float())).item()
        print(f"width {width} {what}: max difference {worst:.2f} ulps of the largest value")
        assert worst <= BOUND_ULPS[torch.bfloat16], f"{what}: {worst:.2f} ulps of the largest value"


@pytest.mark.gpu
def test_float64_on_gpu():
    """float64 statistics and angles, as the reference: only summation order and libdevice's
    cos/sin vs torch's differ, a few float64 ulps (rtol/atol 1e-12)."""
    pytest.importorskip("triton")
    x, positions, inv_freq = _query_case(torch.float64, tokens=64, heads=4)
    upstream = torch.randn_like(x)
    got = _run(triton_norm_rope.norm_rope, x, positions, inv_freq, upstream)
    expected = _run(reference_norm_rope, x, positions, inv_freq, upstream)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_forward_and_backward_replay_in_a_cuda_graph():
    """No host sync or host-to-device copy in the path: forward + backward capture in a CUDA graph,
    and a replay with new inputs equals an eager run (same kernels on the same values: bitwise)."""
    pytest.importorskip("triton")
    x, positions, inv_freq = _query_case(torch.bfloat16, tokens=256, heads=8)
    static_x = x.detach().clone().requires_grad_()
    static_upstream = torch.randn_like(static_x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _run(triton_norm_rope.norm_rope, static_x, positions, inv_freq, static_upstream)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_grad = _run(triton_norm_rope.norm_rope, static_x, positions, inv_freq, static_upstream)
    with torch.no_grad():
        static_x.copy_(torch.randn_like(static_x))
        static_upstream.copy_(torch.randn_like(static_upstream))
    graph.replay()
    eager_out, eager_grad = _run(triton_norm_rope.norm_rope, static_x, positions, inv_freq, static_upstream)
    assert torch.equal(static_out, eager_out) and torch.equal(static_grad, eager_grad)
