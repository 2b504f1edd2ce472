"""`make_graphed_layers` on a GPU: graphed training steps equal eager steps of a twin layer (outputs,
input and parameter gradients, indexer loss), over several steps with new inputs, accumulated
micro-batches, two layers in a chain and packed input with changed boundaries.

Skipped without a GPU (the `gpu` marker, see conftest.py).

Tolerances. bf16 (dsv4-flash dims): the replays run the kernels an eager step runs, on the same values;
only gradients accumulated with float32 atomics (dkv, the indexer keys) change with the summation order,
so the bf16 bounds of the fused-vs-unfused layer tests (`test_backends_gpu.assert_close_bf16`) hold with
a wide margin, and the indexer parameters (trained by the KL loss only, through a top-k whose near ties
a different rounding may flip) use cosine ≥ 0.99 like the whole-step capture test. The forward has no
atomics: the indexer loss is compared at rtol 1e-3. float32 (packed, tiny dims): the bounds of the
packed capture test (`test_packed_gpu.assert_close_f32`). A replay reading a stale input, stale
boundaries or a gradient buffer overwritten by the next replay is off by O(1).
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig, make_graphed_layers
from megatron_dsa.backends import BackendUnavailableError, OpFamily, call_counts, dispatch, reset_call_counts
from megatron_dsa.ops.layout import TokenLayout
from test_backends_gpu import assert_close_bf16, cosine
from test_packed_gpu import (GRAPH_LAYOUTS, GRAPH_MAX_SEQLEN, assert_close_f32, cuda_layer, cuda_pack,  # noqa: F401
                             no_tf32)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def flash_layer(kind: str) -> HybridAttention:
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset("dsv4-flash", num_layers=1, layer_pattern=kind)
    return HybridAttention(config, kind=kind).to(CUDA, torch.bfloat16).train()


def hidden(layer: HybridAttention, rows: int = 1024) -> torch.Tensor:
    return torch.randn(rows, 1, layer.config.hidden_size, device=CUDA).bfloat16().requires_grad_()


def grads_of(layer: HybridAttention) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}


def assert_grads_match(graphed: dict, eager: dict, what: str) -> None:
    assert graphed.keys() == eager.keys(), f"{what}: {sorted(graphed.keys() ^ eager.keys())}"
    for name, expected in eager.items():
        if "indexer" in name:
            assert cosine(graphed[name], expected) >= 0.99, f"{what}: {name}"
        else:
            assert_close_bf16(f"{what}: {name}", graphed[name], expected, grad=True)


def assert_losses_match(graphed, eager) -> None:
    assert (graphed is None) == (eager is None)
    if eager is not None:
        torch.testing.assert_close(graphed.float(), eager.float(), rtol=1e-3, atol=0)


@pytest.mark.parametrize("kind", ["W", "C", "H", "M"])
def test_graphed_steps_match_eager_steps(kind) -> None:
    """Three steps on new inputs: output, input grad, every parameter grad and the indexer loss equal
    those of an eager twin; the first two steps accumulate (no zeroing in between), as micro-batches
    do. A replay issues no dispatch (the layer's Python does not run), and capture used fused kernels."""
    layer = flash_layer(kind)
    twin = copy.deepcopy(layer)
    reset_call_counts()
    (graphed,) = make_graphed_layers([layer], [hidden(layer)])
    assert any(backend != "unfused" for backend, _ in call_counts()), call_counts()  # M: our Triton dense kernels
    for step, zero_first in enumerate([True, False, True]):
        if zero_first:
            layer.zero_grad(set_to_none=True)
            twin.zero_grad(set_to_none=True)
        x, grad = hidden(layer), torch.randn(1024, 1, layer.config.hidden_size, device=CUDA).bfloat16()
        x_twin = x.detach().clone().requires_grad_()
        reset_call_counts()
        out, bias = graphed(x)
        out.backward(grad)
        assert bias is None and call_counts() == {}, call_counts()
        expected, _ = twin(x_twin)
        expected.backward(grad)
        assert_close_bf16(f"step {step}: output", out, expected, grad=False)
        assert_close_bf16(f"step {step}: input grad", x.grad, x_twin.grad, grad=True)
        assert_grads_match(grads_of(layer), grads_of(twin), f"step {step}")
        assert_losses_match(graphed.last_indexer_loss, twin.last_indexer_loss)


@pytest.mark.parametrize("backend", ["flash_attn", "cudnn", "triton", "torch_sdpa"])
def test_graphed_m_layer_at_deepseek_v3_dims_matches_eager_on_every_dense_backend(backend) -> None:
    """The M kind at DeepSeek-V3's MLA head dims (qk 128 + 64, v 128), where every fused dense backend takes
    the attention: its captured step replays equal to an eager twin. Capture refuses a host-to-device copy,
    which is how FlashAttention's varlen bounds (their last offset set from a host int) once failed; the
    eager tests never saw it. Skips only where the backend's optional package is not installed."""
    probe = dispatch_or_skip(backend)
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset(
        "dsv4-flash", num_layers=1, layer_pattern="M", hidden_size=1024, num_attention_heads=16, q_lora_rank=512,
        qk_head_dim=128, kv_lora_rank=512, v_head_dim=128, attention_backend_overrides={"dense_attention": backend})
    layer = HybridAttention(config, kind="M").to(CUDA, torch.bfloat16).train()
    twin = copy.deepcopy(layer)
    reset_call_counts()
    (graphed,) = make_graphed_layers([layer], [hidden(layer)])
    assert call_counts().get((backend, "dense_attention"), 0) > 0, (probe, call_counts())
    for step in range(2):
        layer.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        x, grad = hidden(layer), torch.randn(1024, 1, layer.config.hidden_size, device=CUDA).bfloat16()
        x_twin = x.detach().clone().requires_grad_()
        out, _ = graphed(x)
        out.backward(grad)
        expected, _ = twin(x_twin)
        expected.backward(grad)
        assert_close_bf16(f"{backend} step {step}: output", out, expected, grad=False)
        assert_close_bf16(f"{backend} step {step}: input grad", x.grad, x_twin.grad, grad=True)
        assert_grads_match(grads_of(layer), grads_of(twin), f"{backend} step {step}")


def dispatch_or_skip(backend: str) -> str:
    """Skip when `backend`'s optional package is absent (the vendor stack); any other decline fails."""
    try:
        dispatch(OpFamily.DENSE_ATTENTION, backend, device=CUDA, dtype=torch.bfloat16, head_dim=192, v_head_dim=128,
                 heads=16, groups=16, layout=TokenLayout.uniform(1, 1024, CUDA), lse_grad=False)
    except BackendUnavailableError as error:
        if backend in ("flash_attn", "cudnn") and "not importable" in str(error):
            pytest.skip(f"{backend}'s optional package is not installed on this machine (the vendor stack): {error}")
        raise
    return backend


def test_two_graphed_layers_in_a_chain_match_eager() -> None:
    """C then H sharing one memory pool: forwards in order, backwards in reverse; the gradient that
    leaves the H layer's graph feeds the C layer's graph."""
    layers = [flash_layer("C"), flash_layer("H")]
    twins = copy.deepcopy(layers)
    graphed = make_graphed_layers(layers, [hidden(layers[0]), hidden(layers[1])])

    def step(modules, x):
        middle, _ = modules[0](x)
        out, _ = modules[1](middle * 0.5 + x)
        return out

    for _ in range(2):
        for module in layers + twins:
            module.zero_grad(set_to_none=True)
        x = hidden(layers[0])
        x_twin = x.detach().clone().requires_grad_()
        grad = torch.randn_like(x)
        out = step(graphed, x)
        out.backward(grad)
        expected = step(twins, x_twin)
        expected.backward(grad)
        assert_close_bf16("output", out, expected, grad=False)
        assert_close_bf16("input grad", x.grad, x_twin.grad, grad=True)
        for layer, twin, name in zip(layers, twins, "CH"):
            assert_grads_match(grads_of(layer), grads_of(twin), name)
            assert_losses_match(layer.last_indexer_loss, twin.last_indexer_loss)


@pytest.mark.parametrize("variant", ["C-sparse-mean", "C-dense-per_token", "H"])
def test_graphed_packed_layer_with_changed_boundaries_matches_eager(variant, no_tf32) -> None:
    """Captured on one packing, replayed on another of the same capacity and segment count (new
    PackedSeqParams objects each step, as a data loader makes them): equal to the eager twin."""
    layer = cuda_layer(variant)
    twin = copy.deepcopy(layer)
    width = layer.config.hidden_size
    batches = {key: cuda_pack(**spec, width=width, max_seqlen=GRAPH_MAX_SEQLEN) for key, spec in GRAPH_LAYOUTS.items()}
    sample, _ = batches["first"]
    (graphed,) = make_graphed_layers([layer], [sample.hidden.detach().requires_grad_()], sample.params)
    for key in ("second", "first", "second"):
        packed, grads = batches[key]
        grad_out = packed.like(grads).unsqueeze(1)
        layer.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        x = packed.hidden.detach().clone().requires_grad_()
        x_twin = packed.hidden.detach().clone().requires_grad_()
        out, _ = graphed(x, packed_seq_params=packed.params)
        out.backward(grad_out)
        expected, _ = twin(x_twin, packed_seq_params=packed.params)
        expected.backward(grad_out)
        assert_close_f32(out.detach(), expected.detach(), f"{key}: output")
        assert_close_f32(x.grad, x_twin.grad, f"{key}: input grad")
        eager = grads_of(twin)
        for name, got in grads_of(layer).items():
            assert_close_f32(got, eager[name], f"{key}: grad of {name}")
        assert_losses_match(graphed.last_indexer_loss, twin.last_indexer_loss)
    too_long = copy.copy(sample.params)
    too_long.max_seqlen_q = GRAPH_MAX_SEQLEN + 1
    with pytest.raises(ValueError, match=f"at most the captured bound {GRAPH_MAX_SEQLEN}"):
        graphed(sample.hidden.detach().requires_grad_(), packed_seq_params=too_long)


def parallel_graphs_body(rank: int, world: int, tp: int, kinds: str) -> None:
    """Every kind of `kinds` on TP `tp` × CP `world // tp` (SP under TP): three steps of the graphed layer
    against an eager twin with the same weights on the same rank. Failures are collected and raised at the
    end, so that no rank leaves the others waiting in a collective."""
    from megatron_dsa.parallel import initialize_parallel_state
    from megatron_dsa.parallel.context import shard_sequence

    cp = world // tp
    state = initialize_parallel_state(tp_size=tp, cp_size=cp)
    failures: list[str] = []

    def check(what: str, compare) -> None:
        try:
            compare()
        except AssertionError as error:
            failures.append(f"rank {rank} {what}: {error}")

    def local_rows(full: torch.Tensor) -> torch.Tensor:
        rows = shard_sequence(full, cp, state.cp_rank, "zigzag")
        return rows.chunk(tp)[state.tp_rank] if tp > 1 else rows

    for kind in kinds:
        config = HybridAttentionConfig.from_preset("dsv4-flash", num_layers=1, layer_pattern=kind,
                                                   sequence_parallel=tp > 1)
        torch.manual_seed(0)
        layer = HybridAttention(config, kind=kind, parallel_state=state).to(CUDA, torch.bfloat16).train()
        twin = HybridAttention(config, kind=kind, parallel_state=state).to(CUDA, torch.bfloat16).train()
        twin.load_state_dict(layer.state_dict())

        def sample(seed: int) -> torch.Tensor:
            torch.manual_seed(seed)  # the same global sequence on every rank
            return local_rows(torch.randn(2048, 1, config.hidden_size, device=CUDA)).bfloat16().requires_grad_()

        reset_call_counts()
        (graphed,) = make_graphed_layers([layer], [sample(1)])
        check(f"{kind} capture used fused kernels", lambda: assert_fused(call_counts()))
        for step, zero_first in enumerate([True, False, True]):
            if zero_first:
                layer.zero_grad(set_to_none=True)
                twin.zero_grad(set_to_none=True)
            x = sample(10 + step)
            grad = torch.randn_like(x)
            x_twin = x.detach().clone().requires_grad_()
            reset_call_counts()
            out, _ = graphed(x)
            out.backward(grad)
            replayed = call_counts()
            expected, _ = twin(x_twin)
            expected.backward(grad)
            what = f"{kind} TP {tp} CP {cp} step {step}"
            check(what + " replay dispatched nothing", lambda: assert_no_dispatch(replayed))
            check(what + " output", lambda: assert_close_bf16("output", out, expected, grad=False))
            check(what + " input grad", lambda: assert_close_bf16("input grad", x.grad, x_twin.grad, grad=True))
            check(what + " parameter grads", lambda: assert_grads_match(grads_of(layer), grads_of(twin), what))
            check(what + " indexer loss", lambda: assert_losses_match(graphed.last_indexer_loss,
                                                                      twin.last_indexer_loss))
        del graphed
    assert not failures, "\n".join(failures)


def assert_fused(counts: dict) -> None:
    assert any(backend != "unfused" for backend, _ in counts), counts


def assert_no_dispatch(counts: dict) -> None:
    assert counts == {}, f"a replay runs no layer Python, but the dispatcher counted {counts}"


@pytest.mark.multigpu
@pytest.mark.parametrize("world, tp, kinds", [(2, 1, "WCHM"), (2, 2, "CM"), (4, 2, "CH")],
                         ids=["CP-2", "TP-2+SP", "TP-2+SPxCP-2"])
def test_graphed_parallel_layers_match_eager_on_nccl(world, tp, kinds) -> None:
    """The collectives of CP (halo exchange, entry all-gathers, the M ring's P2P) and TP + SP (sequence
    all-gather, reduce-scatter, the latents' all-reduces) inside captured graphs: replays equal eager steps of
    the same layer on 2 or 4 GPUs (tolerances as the one-GPU graph tests above)."""
    from distributed import need_gpus, run_distributed

    need_gpus(world)
    run_distributed(parallel_graphs_body, world, tp, kinds, backend="nccl", timeout_s=400)
