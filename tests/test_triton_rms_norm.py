"""Triton RMSNorm vs the reference `megatron_dsa.ops.norms.rms_norm`.

CPU: the kernels run in the Triton interpreter in a child process (`interp_triton_rms_norm.py`; see
`triton_support.py` for why), plus the dispatcher's answers. GPU: bf16 rows of the layer's norm
widths (D = 512, 1024), through the dispatcher, so the call counter proves the kernel ran.
"""

import pytest
import torch

from megatron_dsa.backends import (BackendUnavailableError, OpFamily, call_counts, dispatch, reset_call_counts,
                                   resolve)
from megatron_dsa.backends.triton_kernels import rms_norm as triton_rms_norm
from distributed import cosine, relative_error
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)

EPS = 1e-6


def test_interpreted_kernels():
    run_interpreted("interp_triton_rms_norm.py")


def test_cpu_without_interpreter_is_refused(without_interpreter):
    with pytest.raises(ValueError, match="cannot run on x's device"):
        triton_rms_norm.rms_norm(torch.randn(4, 16), torch.ones(16), EPS)


def test_dispatch_on_cpu_picks_unfused_and_refuses_an_explicit_triton(monkeypatch):
    """`auto` on CPU runs the reference; naming `triton` for CPU tensors (no interpreter) fails with
    the dispatcher's reason instead of falling back."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert resolve(OpFamily.RMS_NORM, device=cpu, dtype=dtype)[0] == "unfused"
    pytest.importorskip("triton")
    with pytest.raises(BackendUnavailableError, match="backend 'triton' cannot run rms_norm: .*Triton needs CUDA"):
        resolve(OpFamily.RMS_NORM, "triton", device=cpu, dtype=torch.float32)


def _bf16_ulp(value: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each value (8 significant bits), the smallest normal's at 0."""
    _, exponent = torch.frexp(value.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny))
    return torch.ldexp(torch.ones_like(value, dtype=torch.float32), exponent - 8)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [512, 1024])
def test_bf16_matches_unfused_on_gpu(width):
    """bf16 x and weight, against the reference in the same dtype through the dispatcher.

    Output: both compute (x·rstd)·w in float32 and round once; only the float32 rstd differs (another
    summation order, Triton's rsqrt: a few float32 ulps), which can flip that one rounding: every
    element equal or 1 bf16 ulp apart. Gradients: dx is rounded once from float32 on both sides (same
    argument, plus the order of mean(gn·x)); dweight is a float32 sum over 4096 rows in another
    order, rounded once to bf16. So both differ by bf16 rounding noise (2^-8 relative per element),
    nowhere near a wrong formula: cosine ≥ 0.9999 and relative error ≤ 1e-2 (a missing rstd³ term or
    an unscaled weight gradient gives a relative error of order 1).
    """
    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = torch.rand(4096, 1, device="cuda", generator=gen) * 4 + 0.1
    x = (torch.randn(4096, width, device="cuda", generator=gen) * scale).bfloat16()
    weight = (1 + 0.5 * torch.randn(width, device="cuda", generator=gen)).bfloat16()
    upstream = torch.randn(4096, width, device="cuda", generator=gen).bfloat16()

    def run(backend):
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = dispatch(OpFamily.RMS_NORM, backend, device=x.device, dtype=x.dtype)(xs, ws, EPS)
        out.backward(upstream)
        return out.detach(), xs.grad, ws.grad

    reset_call_counts()
    got = run("triton")
    assert call_counts() == {("triton", "rms_norm"): 1}
    expected = run("unfused")
    out, ref = got[0].float(), expected[0].float()
    worst = ((out - ref).abs() / _bf16_ulp(expected[0])).max().item()
    print(f"D={width} out: max {worst:.2f} bf16 ulps, {(out != ref).float().mean().item():.2%} differ")
    assert worst <= 1.0, f"out: {worst:.2f} bf16 ulps apart"
    for what, a, b in zip(("dx", "dweight"), got[1:], expected[1:]):
        assert a.dtype == b.dtype == torch.bfloat16, what
        print(f"D={width} {what}: cosine {cosine(a, b):.7f}, relative error {relative_error(a, b):.2e}")
        assert cosine(a, b) >= 0.9999, f"{what}: cosine {cosine(a, b)}"
        assert relative_error(a, b) <= 1e-2, f"{what}: relative error {relative_error(a, b)}"
