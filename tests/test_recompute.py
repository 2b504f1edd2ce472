"""Activation recompute: the layer's `recompute_attention` and Megatron's full and selective
recompute around our layers change no output and no gradient, and keep fewer tensors.

fp64 on CPU, where a recomputed forward repeats the first one bit for bit: outputs and gradients
must be identical, not just close.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig

SEQ, BATCH = 48, 2


def config_for(kind: str, **changes) -> HybridAttentionConfig:
    return HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern=kind, csa_window_size=8,
                                             hca_compress_ratio=8, dsa_indexer_topk=3,
                                             dsa_indexer_loss_coeff=0.5, **changes)


def run(layer: HybridAttention, x: torch.Tensor, upstream: torch.Tensor):
    """(output, input grad, parameter grads, indexer loss, bytes autograd saved)."""
    saved = []
    x = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out, _ = layer(x)
    (out * upstream).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads, layer.last_indexer_loss, sum(saved)


@pytest.mark.parametrize("kind", "WCHM")
def test_recompute_attention_changes_nothing_but_memory(kind: str) -> None:
    torch.manual_seed(2)
    plain = HybridAttention(config_for(kind), kind=kind).double()
    recomputed = HybridAttention(config_for(kind, recompute_attention=True), kind=kind).double()
    recomputed.load_state_dict(plain.state_dict())
    x = torch.randn(SEQ, BATCH, plain.config.hidden_size, dtype=torch.float64)
    upstream = torch.randn_like(x)
    expected, got = run(plain, x, upstream), run(recomputed, x, upstream)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=0, atol=0, msg=name)
    if kind == "C":
        torch.testing.assert_close(got[3], expected[3], rtol=0, atol=0)
    # Kept: the input rows and linear_proj's input (each SEQ·BATCH rows), nothing per head.
    assert got[4] < expected[4] / 3, (got[4], expected[4])


def test_recompute_attention_is_a_strict_bool() -> None:
    with pytest.raises(ValueError, match="recompute_attention"):
        config_for("W", recompute_attention="false")


RECOMPUTE = {"full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mla_up_proj"])}


def megatron_body(rank: int, world: int, mode: str, device: str) -> None:
    """A GPTModel with every kind, without and with `mode` recompute: same loss and gradients."""
    from megatron.core import parallel_state, tensor_parallel

    from test_megatron_integration import megatron_config, tiny
    from megatron_dsa.integrations.megatron import hybrid_gpt_model

    parallel_state.initialize_model_parallel(1)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # full recompute restores the CUDA RNG
    hybrid = tiny("WCHM")
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    positions = torch.arange(32, device=device).expand(2, 32)
    results = {}
    for name in ("none", mode):
        config, overrides = megatron_config(hybrid, **RECOMPUTE.get(name, {}))
        torch.manual_seed(0)
        model = hybrid_gpt_model(config, 64, 32, **overrides).to(device)
        recomputing = [layer.self_attention.config.recompute_attention for layer in model.decoder.layers]
        assert all(recomputing) == (name == "selective") and any(recomputing) == all(recomputing), (name, recomputing)
        loss = model(tokens, positions, None, labels=tokens).mean()
        loss.backward()
        results[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    # CPU repeats every sum in the same order; GPU backward kernels add some gradients with atomics
    # (the indexer's dk, cuDNN's sparse dkv), whose order varies run to run: ~1e-6 relative in fp32.
    rtol, atol = (1e-6, 1e-9) if device == "cpu" else (1e-4, 1e-6)
    torch.testing.assert_close(results[mode][0], results["none"][0], rtol=rtol, atol=atol, msg=mode)
    for key, grad in results["none"][1].items():
        torch.testing.assert_close(results[mode][1][key], grad, rtol=rtol, atol=atol, msg=f"{mode}: {key}")


def test_megatron_selective_recompute_keeps_gradients() -> None:
    pytest.importorskip("megatron.core", reason='megatron-core is not installed (pip install -e ".[megatron]")')
    from distributed import run_distributed

    run_distributed(megatron_body, 1, "selective", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_megatron_recompute_keeps_gradients_on_gpu(mode: str) -> None:
    """Megatron's full recompute saves and restores the CUDA RNG state: GPU only. fp32 weights,
    the fused backends: a recomputed forward repeats the first (same kernels, same inputs)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from distributed import run_distributed

    run_distributed(megatron_body, 1, mode, "cuda", backend="nccl")
