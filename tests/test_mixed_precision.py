"""Mixed precision the Megatron way: autocast over fp32 parameters (bf16 or fp32 input), bf16
parameters (`Float16Module`, with `attn_sink` / `ape` kept in fp32), and bf16 parameters under
autocast. Each mode is compared with an fp64 run of the same weights: output, input gradient and
every parameter gradient.

Tolerances: bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per value); a layer chains
~6 rounded GEMMs and norms, so outputs and gradients land near 1e-2 relative error (measured on
CPU: 0.5-2e-2); the bound is 5e-2 and cosine 0.999. A wrong dtype path (a missing cast, a dropped
term, a sink rounded to bf16) shows as a cosine below 0.99 or a relative error near 1. Indexer
parameters learn only from the KL loss, a difference of nearly equal rounded probabilities: 0.1 and
cosine 0.99 there (measured 1.3e-2).
"""

from __future__ import annotations

import pytest
import torch

from distributed import cosine, relative_error
from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import call_counts, reset_call_counts

SEQ, BATCH = 48, 2
MODES = ("autocast, fp32 params, bf16 input", "autocast, fp32 params, fp32 input", "bf16 params",
         "bf16 params under autocast")


def small_config(kind: str) -> HybridAttentionConfig:
    return HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern=kind, csa_window_size=8,
                                             hca_compress_ratio=8, dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.5)


def run(layer: HybridAttention, x: torch.Tensor, upstream: torch.Tensor, autocast: bool):
    x = x.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out, _ = layer(x)
    (out.double() * upstream).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return out, x.grad, grads


def build(kind: str, mode: str, device: str = "cpu") -> tuple[HybridAttention, HybridAttention]:
    """(the layer in `mode`, its fp64 twin with the same weights)."""
    torch.manual_seed(5)
    layer = HybridAttention(small_config(kind), kind=kind)
    if hasattr(layer, "core_attention"):
        with torch.no_grad():
            layer.core_attention.attn_sink.normal_()
    reference = HybridAttention(small_config(kind), kind=kind).double()
    reference.load_state_dict(layer.state_dict())
    if mode.startswith("bf16 params"):
        layer = layer.bfloat16()
    return layer.to(device), reference


def check_mode(kind: str, mode: str, device: str = "cpu") -> None:
    layer, reference = build(kind, mode, device)
    x = torch.randn(SEQ, BATCH, layer.config.hidden_size, dtype=torch.float64)
    upstream = torch.randn(SEQ, BATCH, layer.config.hidden_size, dtype=torch.float64)
    expected = run(reference, x, upstream, autocast=False)
    low = torch.bfloat16 if mode != "autocast, fp32 params, fp32 input" else torch.float32
    got = run(layer, x.to(device, low), upstream.to(device), autocast="autocast" in mode)
    assert got[0].dtype == torch.bfloat16, f"{mode}: output dtype {got[0].dtype}"
    pairs = [("output", got[0], expected[0]), ("input grad", got[1], expected[1])]
    pairs += [(f"grad {name}", got[2][name], grad) for name, grad in expected[2].items()]
    for what, actual, wanted in pairs:
        assert actual is not None, f"kind {kind}, {mode}: no {what}"
        actual = actual.detach().double().cpu()
        assert torch.isfinite(actual).all(), f"kind {kind}, {mode}: {what} not finite"
        loose = "indexer" in what
        assert cosine(actual, wanted) > (0.99 if loose else 0.999), \
            f"kind {kind}, {mode}: {what} cosine {cosine(actual, wanted):.5f}"
        assert relative_error(actual, wanted) < (0.1 if loose else 0.05), \
            f"kind {kind}, {mode}: {what} relative error {relative_error(actual, wanted):.3e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", "WCHM")
def test_mixed_precision_matches_fp64(kind: str, mode: str) -> None:
    check_mode(kind, mode)


@pytest.mark.parametrize("kind", "WCH")
def test_bf16_params_keep_fp32_sink_and_ape_and_their_grads(kind: str) -> None:
    layer, _ = build(kind, "bf16 params")
    core = layer.core_attention
    fp32 = {"core_attention.attn_sink"} | {name for name, _ in core.named_parameters(prefix="core_attention")
                                           if name.endswith(".ape")}
    x = torch.randn(SEQ, BATCH, layer.config.hidden_size, dtype=torch.bfloat16)
    run(layer, x, torch.ones(SEQ, BATCH, layer.config.hidden_size, dtype=torch.float64), autocast=False)
    for name, param in layer.named_parameters():
        assert param.dtype == (torch.float32 if name in fp32 else torch.bfloat16), name
        assert param.grad is not None and param.grad.dtype == param.dtype, name


def test_input_dtype_mismatch_outside_autocast_names_the_fix() -> None:
    layer = HybridAttention(small_config("W"), kind="W")
    with pytest.raises(TypeError, match="torch.autocast"):
        layer(torch.randn(8, 1, layer.config.hidden_size, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(8, 1, layer.config.hidden_size, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", "WCHM")
def test_mixed_precision_matches_fp64_on_gpu(kind: str, mode: str) -> None:
    """The fused backends under each mode; the counters prove a fused attention ran."""
    reset_call_counts()
    check_mode(kind, mode, "cuda")
    fused = {op for (backend, op), calls in call_counts().items() if backend != "unfused" and calls}
    assert fused, f"kind {kind}, {mode}: only the unfused reference ran: {call_counts()}"


def float16_module_body(rank: int, world: int) -> None:
    """A GPTModel with our layers inside Megatron's `Float16Module` (bf16=True): bf16 weights except
    the fp32 sinks and compressor biases, and a loss within bf16 rounding of the fp32 model's."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    from test_megatron_integration import megatron_config, tiny
    from megatron_dsa.integrations.megatron import hybrid_gpt_model

    parallel_state.initialize_model_parallel(1)
    hybrid = tiny("WCHM")
    losses = {}
    for bf16 in (False, True):
        config, overrides = megatron_config(hybrid, bf16=bf16)
        torch.manual_seed(0)
        model = hybrid_gpt_model(config, 64, 32, **overrides)
        if bf16:
            model = Float16Module(config, model)
            for name, param in model.named_parameters():
                if "self_attention" in name:
                    wanted = torch.float32 if name.endswith(("attn_sink", ".ape")) else torch.bfloat16
                    assert param.dtype == wanted, f"{name}: {param.dtype}"
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(32).expand(2, 32)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        losses[bf16] = float(loss)
    assert abs(losses[True] - losses[False]) < 2e-2 * abs(losses[False]), losses


def test_megatron_float16_module_runs_the_hybrid_layers() -> None:
    pytest.importorskip("megatron.core", reason='megatron-core is not installed (pip install -e ".[megatron]")')
    from distributed import run_distributed

    run_distributed(float16_module_body, 1)
