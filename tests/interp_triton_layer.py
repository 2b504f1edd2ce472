"""The whole layer with every Triton kernel (interpreter, fp32) equals the unfused layer: output,
input grad, every parameter grad and the indexer loss, for W, C (sparse and dense loss) and H.

Not collected by the default suite: `test_triton_layer.py` runs it in a child process under the
interpreter (`triton_support.run_interpreted` says why). Tolerance: fp32 kernels vs fp32 reference
differ only in summation order (and atomics order), rtol/atol 1e-4 on values of order 1."""

from __future__ import annotations

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import call_counts, reset_call_counts
from triton_support import interpreter  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("interpreter")

TRITON_OPS = ("sparse_attention_fwd", "sparse_attention_bwd", "indexer_scores", "topk", "selection_rows",
              "indexer_loss", "indexer_kl_bwd", "compressor", "rope", "norm_rope", "rms_norm")
TOL = dict(rtol=1e-4, atol=1e-4)


def run(layer: HybridAttention, x: torch.Tensor, upstream: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(upstream)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}, layer.last_indexer_loss


@pytest.mark.parametrize("kind,sparse_loss", [("W", True), ("C", True), ("C", False), ("H", True)])
def test_layer_with_triton_kernels_matches_unfused(kind, sparse_loss):
    config = HybridAttentionConfig.from_preset(
        "tiny", num_layers=1, layer_pattern=kind, hca_compress_ratio=8, csa_window_size=8,
        dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.5, dsa_indexer_use_sparse_loss=sparse_loss)
    torch.manual_seed(0)
    reference = HybridAttention(config.replace(attention_backend="unfused"), kind=kind).train()
    with torch.no_grad():
        reference.core_attention.attn_sink.normal_()
    fused = HybridAttention(config.replace(attention_backend_overrides={op: "triton" for op in TRITON_OPS}),
                            kind=kind).train()
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(24, 2, config.hidden_size)
    upstream = torch.randn_like(x)
    expected = run(reference, x, upstream)
    reset_call_counts()
    got = run(fused, x, upstream)
    used = {op for (backend, op), calls in call_counts().items() if backend == "triton" and calls}
    wanted = {"sparse_attention_fwd", "sparse_attention_bwd", "rope", "norm_rope", "rms_norm"}
    if kind != "W":
        wanted.add("compressor")
    if kind == "C":
        wanted |= {"indexer_scores", "topk", "selection_rows", "indexer_loss", "indexer_kl_bwd"}
    assert used == wanted, f"triton ran {sorted(used)}, expected {sorted(wanted)}"
    # q_layernorm alone: kv_layernorm's weight goes into the kv rows' fused norm + RoPE
    assert call_counts()[("triton", "rms_norm")] == 1
    assert call_counts()[("triton", "norm_rope")] == 2  # the query's and the kv rows'
    torch.testing.assert_close(got[0], expected[0], **TOL, msg="output")
    torch.testing.assert_close(got[1], expected[1], **TOL, msg="input grad")
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, **TOL, msg=name)
    if expected[3] is not None:
        torch.testing.assert_close(got[3], expected[3], **TOL, msg="indexer loss")
