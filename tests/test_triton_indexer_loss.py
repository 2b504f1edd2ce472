"""Triton indexer-loss kernels (teacher attention mass, per-row KL) vs the unfused reference.

CPU: the kernels run in the Triton interpreter in a child process (`interp_triton_indexer_loss.py`;
see `triton_support.py` for why). GPU: dsv4 dims (T=4096, H=64 local heads, D=512; the sparse loss's
C=512 selected entries and the dense loss's C=T/4 causal entries) vs the reference in float32.
"""

import pytest
import torch

from megatron_dsa.backends.triton_kernels import indexer_loss as triton_loss
from megatron_dsa.ops.indexer_loss import kl_per_row as reference_kl
from indexer_cases import causal_candidates, random_candidates
from indexer_loss_cases import SCALE, kl_inputs, mass_inputs, reference_mass, run_kl
from triton_support import run_interpreted, without_interpreter  # noqa: F401  (fixture)

TOKENS, HEADS, DIM = 4096, 64, 512


def test_interpreted_kernels():
    run_interpreted("interp_triton_indexer_loss.py")


def test_cpu_without_interpreter_is_refused(without_interpreter):
    cand = random_candidates(4, 5, 3)
    query, kv, lse = mass_inputs(4, 2, 16, 3, cand)
    with pytest.raises(ValueError, match="cannot run on the inputs' device"):
        triton_loss.attention_mass(query, kv, cand, lse, SCALE)
    with pytest.raises(ValueError, match="cannot run on the inputs' device"):
        triton_loss.kl_per_row(*kl_inputs(4, 5))


def _gpu_candidates(kind):
    """Sparse: 512 arbitrary ids among the T + T/4 kv rows (token rows, then compressed ones), −1
    anywhere. Dense: the T/4 compressed entries in causal order (−1 in the future), offset past the
    token rows as the layer's `offset_valid` does."""
    if kind == "sparse":
        return random_candidates(TOKENS, 512, TOKENS + TOKENS // 4)
    cand = causal_candidates(TOKENS, TOKENS // 4)
    return torch.where(cand >= 0, cand + TOKENS, -1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_attention_mass_dsv4_dims_on_gpu(kind, dtype):
    """Vs the float32 reference on the same (dtype-rounded) inputs. Products of 16-bit values are
    exact in float32, so the logits differ only by the order of 512 float32 additions (|logit| up to
    ~30 at SCALE=0.37: ≤ ~1e-5 absolute), and exp is the GPU's approximate exp2 (~2 ulp): relative
    error ≤ ~2e-5, checked as rtol 1e-4 with atol 1e-7 for masses that underflow towards 0."""
    pytest.importorskip("triton")
    cand = _gpu_candidates(kind).cuda()
    query, kv, lse = mass_inputs(TOKENS, HEADS, DIM, TOKENS + TOKENS // 4, cand, dtype=dtype, device="cuda")
    got = triton_loss.attention_mass(query, kv, cand, lse, SCALE)
    assert torch.isfinite(got).all() and torch.equal(got[cand < 0], torch.zeros_like(got[cand < 0]))
    torch.testing.assert_close(got, reference_mass(query, kv, cand, lse), rtol=1e-4, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [512, TOKENS // 4])
def test_kl_dsv4_dims_on_gpu(width):
    """float32 in both. The GPU's approximate exp2/log2 (~2 ulp) on log-probabilities of size ≤ ~20
    give ~1e-5 absolute per KL row (sums of terms `target·(log target − log pred)` with Σ target = 1):
    rtol/atol 1e-4. Gradients `g·(pred·Σ target − target)` with pred ≤ 1: atol 1e-7, rtol 1e-4."""
    pytest.importorskip("triton")
    student, target, valid = kl_inputs(TOKENS, width, device="cuda")
    upstream = torch.randn(TOKENS, device="cuda")
    got, got_grad = run_kl(triton_loss.kl_per_row, student, target, valid, upstream)
    ref, ref_grad = run_kl(reference_kl, student, target, valid, upstream)
    assert torch.isfinite(got).all() and torch.isfinite(got_grad).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-4, atol=1e-7)
    assert torch.equal(got_grad[~valid], torch.zeros_like(got_grad[~valid]))
