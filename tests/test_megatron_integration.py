"""Megatron-Core GPTModel built with the hybrid layer spec: same attention as our standalone layer.

Needs megatron-core (`pip install -e ".[megatron]"`); skipped without it. Models are built in spawned
gloo processes because Megatron keeps its process groups in module globals.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason='megatron-core is not installed (pip install -e ".[megatron]")')

import torch.distributed as dist  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

from distributed import run_distributed  # noqa: E402
from megatron_dsa import HybridAttention, HybridAttentionConfig, LayerKind  # noqa: E402
from megatron_dsa.integrations import megatron as integration  # noqa: E402
from megatron_dsa.integrations.checkpoint import convert_attention  # noqa: E402
from megatron_dsa.integrations.megatron_config import to_megatron_kwargs  # noqa: E402
from megatron_dsa.layers.cores import DENSE_MLA  # noqa: E402
from megatron_dsa.layers.kinds import KINDS  # noqa: E402
from megatron_dsa.parallel.sharding import gather_full_state_dict, partition_dims  # noqa: E402

SEQ, BATCH, VOCAB = 32, 2, 64


def megatron_config(hybrid: HybridAttentionConfig, **changes) -> tuple[MLATransformerConfig, dict]:
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    kwargs, overrides = to_megatron_kwargs(hybrid, fields)
    config = MLATransformerConfig(**{**kwargs, **changes}, ffn_hidden_size=96, use_cpu_initialization=True,
                                  hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                                  gated_linear_unit=True)
    return config, overrides


def tiny(pattern: str, **changes) -> HybridAttentionConfig:
    return HybridAttentionConfig.from_preset("tiny", num_layers=len(pattern), layer_pattern=pattern, **changes)


class AttentionRecorder:
    """Records every self_attention's input, output and output gradient in a Megatron model."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [layer.self_attention for layer in model.decoder.layers]
        self.inputs, self.outputs, self.grads = {}, {}, {}
        for index, attention in enumerate(self.layers):
            attention.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def hook(module, args, output):
            self.inputs[index] = args[0].detach().clone()
            self.outputs[index] = output[0].detach().clone()
            output[0].register_hook(lambda grad: self.grads.__setitem__(index, grad.detach().clone()))
        return hook


def run_gpt(rank: int, world: int, pattern: str, sequence_parallel: bool):
    """Build a 2-layer GPTModel with our spec on this group, run fwd+bwd, return model and records."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    hybrid = tiny(pattern, sequence_parallel=sequence_parallel)
    config, overrides = megatron_config(hybrid, tensor_model_parallel_size=world,
                                        sequence_parallel=sequence_parallel)
    torch.manual_seed(0)
    model = integration.hybrid_gpt_model(config, VOCAB, SEQ, **overrides)
    recorder = AttentionRecorder(model)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    model(tokens, positions, None, labels=tokens).float().mean().backward()
    return model, recorder, hybrid


def check_against_standalone(rank: int, world: int, pattern: str, sequence_parallel: bool) -> None:
    model, recorder, hybrid = run_gpt(rank, world, pattern, sequence_parallel)
    state = recorder.layers[0].parallel_state
    # The GPTModel's own state dict is a Megatron-layout attention checkpoint of this TP rank.
    [ours], skipped = convert_attention([model.state_dict()], hybrid, "megatron", "ours") if world == 1 else ([{}], [])
    assert world > 1 or "embedding.word_embeddings.weight" in skipped
    for index, adapter in enumerate(recorder.layers):
        assert adapter.kind.value == pattern[index]
        # One adapter class for every kind; the kind's row picks the core (dense for M).
        assert type(adapter) is integration.MegatronHybridAttention
        assert adapter.core is KINDS[pattern[index]].core
        reference = HybridAttention(hybrid.replace(sequence_parallel=False), layer_number=index + 1)
        reference.load_state_dict(gather_full_state_dict(adapter, state))
        reference.train()
        if world == 1:
            prefix = f"layers.{index}.self_attention."
            reference.load_state_dict({k[len(prefix):]: v for k, v in ours.items() if k.startswith(prefix)})
        full_in, full_grad = recorder.inputs[index], recorder.grads[index]
        if sequence_parallel:
            full_in, full_grad = torch.cat(all_gather(full_in)), torch.cat(all_gather(full_grad))
        x = full_in.clone().requires_grad_(True)
        out, bias = reference(x)
        assert bias is None
        out.backward(full_grad)
        rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world) if sequence_parallel else slice(None)
        torch.testing.assert_close(recorder.outputs[index], out[rows].detach(), rtol=1e-5, atol=1e-6)
        dims = partition_dims(adapter)
        for name, param in adapter.named_parameters():
            expected = dict(reference.named_parameters())[name].grad
            grad = param.grad
            if dims[name] is not None and world > 1:
                grad = torch.cat(all_gather(grad), dims[name])
            assert grad is not None, f"layer {index + 1} {name}: no gradient"
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=f"layer {index + 1} {name}")
        if "C" == pattern[index]:
            assert adapter.last_indexer_loss is not None and adapter.last_indexer_loss > 0
            torch.testing.assert_close(adapter.last_indexer_loss, reference.last_indexer_loss)


def all_gather(local: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return parts


def check_indexer_loss_plumbing(rank: int, world: int) -> None:
    """The indexer loss lands in Megatron's DSA tracker (what Megatron-LM's training log reports),
    in the MoE aux-loss tracker only when asked, and its backward scale follows set_indexer_loss_scale."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    grads = {}
    for scale in (1.0, 3.0):
        integration.set_indexer_loss_scale(scale)
        get_moe_layer_wise_logging_tracker().clear()
        integration.tracked_indexer_losses()  # clears what earlier checks tracked
        model, recorder, _ = run_gpt(rank, world, "CH", sequence_parallel=False)
        parallel_state.destroy_model_parallel()
        tracked = integration.tracked_indexer_losses()
        torch.testing.assert_close(torch.tensor(tracked[0]), recorder.layers[0].last_indexer_loss)
        assert tracked[1] == 0  # the H layer has no indexer
        assert integration.tracked_indexer_losses() == [0.0, 0.0]  # cleared by the first read
        assert integration.INDEXER_LOSS_NAME not in get_moe_layer_wise_logging_tracker()
        grads[scale] = {name: p.grad.clone() for name, p in recorder.layers[0].named_parameters()}
    integration.set_indexer_loss_scale(1.0)
    for name, grad in grads[1.0].items():
        factor = 3.0 if ".indexer." in name else 1.0
        torch.testing.assert_close(grads[3.0][name], grad * factor, rtol=1e-5, atol=1e-9, msg=name)

    parallel_state.initialize_model_parallel(1)
    config, overrides = megatron_config(tiny("CH"))
    model = integration.hybrid_gpt_model(config, VOCAB, SEQ, indexer_loss_in_moe_tracker=True, **overrides)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    model(tokens, None, None, labels=tokens).float().mean().backward()
    moe = get_moe_layer_wise_logging_tracker()[integration.INDEXER_LOSS_NAME]["values"]
    torch.testing.assert_close(moe[0], model.decoder.layers[0].self_attention.last_indexer_loss)
    integration.tracked_indexer_losses()
    parallel_state.destroy_model_parallel()


def check_position_signals(rank: int, world: int) -> None:
    """A GPTModel adding learned absolute positions is rejected at build time; position_ids the
    layers cannot honour are rejected at forward time, the right ones (plain or restarting per
    document) pass."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    parallel_state.initialize_model_parallel(1)
    hybrid = tiny("CH")
    config, overrides = megatron_config(hybrid)
    spec = integration.hybrid_layer_spec(integration.hybrid_config_from_megatron(config, **overrides))
    with pytest.raises(ValueError, match="learned absolute"):
        GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="none")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    model(tokens, positions, None)
    with pytest.raises(ValueError, match="position_ids must count"):
        model(tokens, positions + 5, None)
    documents = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    documents[10:, :10] = True
    restarting = torch.cat((torch.arange(10), torch.arange(SEQ - 10))).expand(BATCH, SEQ)
    model(tokens, restarting, documents[None, None])
    with pytest.raises(ValueError, match="restart at every document"):
        model(tokens, positions, documents[None, None])  # --reset-attention-mask without --reset-position-ids
    parallel_state.destroy_model_parallel()


def check_adapter_sequence_parallel(rank: int, world: int) -> None:
    hybrid = tiny("CM", sequence_parallel=True)
    config, _ = megatron_config(hybrid, tensor_model_parallel_size=world, sequence_parallel=True)
    groups = SimpleNamespace(tp=dist.group.WORLD)
    reference_config = hybrid.replace(sequence_parallel=False)
    x = torch.randn(SEQ, BATCH, hybrid.hidden_size, generator=torch.Generator().manual_seed(2))
    grad = torch.randn(SEQ, BATCH, hybrid.hidden_size, generator=torch.Generator().manual_seed(3))
    rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    for number in (1, 2):
        torch.manual_seed(number)
        layer = integration.MegatronHybridAttention(config, number, hybrid_config=hybrid, pg_collection=groups)
        reference = HybridAttention(reference_config, layer_number=number)
        reference.load_state_dict(gather_full_state_dict(layer, layer.parallel_state))
        local = x[rows].clone().requires_grad_(True)
        out, _ = layer(local)
        out.backward(grad[rows])
        full = x.clone().requires_grad_(True)
        expected, _ = reference(full)
        expected.backward(grad)
        torch.testing.assert_close(out, expected[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(local.grad, full.grad[rows], rtol=1e-5, atol=1e-6)


def single_rank_checks(rank: int, world: int) -> None:
    from megatron.core import parallel_state

    for pattern in ("CH", "WM"):  # every kind, both adapter classes
        check_against_standalone(rank, world, pattern, False)
        parallel_state.destroy_model_parallel()
    check_indexer_loss_plumbing(rank, world)
    check_position_signals(rank, world)
    run_user_guide_snippet()


def run_user_guide_snippet() -> None:
    """The Megatron example of docs/user_guide.md section 7 builds a model of the given kinds."""
    import re
    from pathlib import Path

    from megatron.core import parallel_state

    guide = (Path(__file__).resolve().parents[1] / "docs" / "user_guide.md").read_text()
    code = re.search(r"## 7\. Megatron-Core integration\n\n```python\n(.*?)```", guide, re.S).group(1)
    parallel_state.initialize_model_parallel(1)
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - our own documentation
    kinds = "".join(layer.self_attention.kind.value for layer in namespace["model"].decoder.layers)
    assert kinds == "WCHC"


def sequence_parallel_gpt_equals_tp1(rank: int, world: int) -> None:
    """Both with the package's projections and norms and with Megatron's local classes."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sequence_parallel_gpt_with_classes_equals_tp1(rank, world, None)
    sequence_parallel_gpt_with_classes_equals_tp1(rank, world, integration.MegatronHybridAttentionSubmodules(
        ColumnParallelLinear, RowParallelLinear, WrappedTorchNorm))


def sequence_parallel_gpt_with_classes_equals_tp1(rank: int, world: int, submodules) -> None:
    """A TP 2 + SP GPTModel (our SP-capable RMSNorm replaces Megatron's torch norm, which refuses SP)
    and an independently built TP 1 GPTModel of the same seed: same loss, and every gradient equal
    once the SP norms' partial gradients are summed over TP (what finalize_model_grads does).

    GPU only: Megatron's sequence-parallel scatter allocates on the current CUDA device. fp32 on
    both sides; the fused kernels' fp32 dots may round through TF32 (10-bit mantissa) in different
    GEMM splits, so gradients are compared by cosine (> 0.9999) and relative error (< 1e-2): a
    sharding mistake (a missing TP sum, a duplicated head) gives cosines far below 0.99."""
    from megatron.core import parallel_state

    from distributed import cosine, relative_error

    def build_and_run(tp: int, sequence_parallel: bool):
        from megatron.core import tensor_parallel

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # the SP embedding forks Megatron's RNG tracker
        hybrid = tiny("WCHM", sequence_parallel=sequence_parallel)
        config, overrides = megatron_config(hybrid, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
        torch.manual_seed(0)
        model = integration.hybrid_gpt_model(config, VOCAB, SEQ, attention_submodules=submodules, **overrides).cuda()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).cuda()
        loss = model(tokens, None, None, labels=tokens).float().mean()
        loss.backward()
        group = parallel_state.get_tensor_model_parallel_group()
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(grad) for _ in range(tp)]
                dist.all_gather(parts, grad.contiguous(), group=group)
                # A strided split (Megatron's GLU fc1: each rank holds [gate_r; up_r]) interleaves.
                stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
                pieces = [part.chunk(stride, dim) for part in parts]
                grad = torch.cat([piece[i] for i in range(stride) for piece in pieces], dim)
            grads[name] = grad
        norms = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
        parallel_state.destroy_model_parallel()
        return loss.detach(), grads, norms

    loss, grads, norms = build_and_run(world, True)
    assert len(norms) == 2 * 4 + 1, norms  # two per layer and the final norm
    expected_loss, expected, _ = build_and_run(1, False)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-3, atol=1e-5)
    for name, grad in expected.items():
        assert cosine(grads[name], grad) > 0.9999, (name, cosine(grads[name], grad))
        assert relative_error(grads[name], grad) < 1e-2, (name, relative_error(grads[name], grad))


def megatron_classes_equal_tp1_default(rank: int, world: int) -> None:
    """A TP 2 GPTModel whose attention projections and norms are Megatron's local classes (given as
    the spec's submodules) against an independently built TP 1 model with the package's own: the
    classes are Megatron's, the keys unchanged, the loss and every gradient the same."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    megatron_classes = integration.MegatronHybridAttentionSubmodules(ColumnParallelLinear, RowParallelLinear,
                                                                    WrappedTorchNorm)

    def build_and_run(tp: int, submodules):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        config, overrides = megatron_config(tiny("WCHM"), tensor_model_parallel_size=tp)
        torch.manual_seed(0)
        model = integration.hybrid_gpt_model(config, VOCAB, SEQ, attention_submodules=submodules, **overrides)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        loss = model(tokens, None, None, labels=tokens).float().mean()
        loss.backward()
        attention = model.decoder.layers[3].self_attention
        grads = {}
        for name, param in model.named_parameters():
            grad, dim = param.grad, partition_dims(model)[name]
            if dim is not None and tp > 1 and getattr(param, "partition_stride", 1) == 1:
                grad = torch.cat(all_gather(grad), dim)
            grads[name] = grad
        parallel_state.destroy_model_parallel()
        return loss.detach(), grads, attention

    loss, grads, attention = build_and_run(world, megatron_classes)
    assert type(attention.linear_q_up_proj) is ColumnParallelLinear and type(attention.linear_kv_up_proj) is ColumnParallelLinear
    assert type(attention.linear_proj) is RowParallelLinear and type(attention.q_layernorm) is torch.nn.RMSNorm
    expected_loss, expected, _ = build_and_run(1, None)
    assert set(grads) == set(expected)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    for name, grad in expected.items():
        if "mlp.linear_fc1" in name:  # Megatron's GLU fc1 shards interleave gate and up (stride 2)
            continue
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def two_rank_checks(rank: int, world: int) -> None:
    # Megatron's sequence-parallel scatter needs CUDA: the GPTModel runs TP 2 without SP here, the
    # adapter's SP path is checked on its own, and the SP GPTModel on GPUs below.
    from megatron.core import parallel_state

    check_against_standalone(rank, world, "CM", False)
    parallel_state.destroy_model_parallel()
    check_adapter_sequence_parallel(rank, world)
    megatron_classes_equal_tp1_default(rank, world)


def test_gpt_model_attention_equals_standalone_layer_and_indexer_loss_plumbing() -> None:
    """One process (Megatron is imported once): W/C/H/M layers of 2-layer GPTModels vs standalone
    layers with the same weights (outputs, input and parameter gradients, indexer loss), then the
    tracker and the loss scale."""
    run_distributed(single_rank_checks, 1)


def test_tp2_gpt_model_and_sequence_parallel_adapter_equal_tp1_layer() -> None:
    run_distributed(two_rank_checks, 2)


@pytest.mark.multigpu
def test_tp2_sequence_parallel_gpt_model_equals_tp1_model_on_gpus() -> None:
    run_distributed(sequence_parallel_gpt_equals_tp1, 2, backend="nccl")


# ---------------------------------------------------------------- single-process checks
NO_GROUPS = SimpleNamespace()  # a ProcessGroupCollection without groups: single process


def adapter(pattern: str = "C", **changes) -> integration.MegatronHybridAttention:
    hybrid = tiny(pattern)
    config, _ = megatron_config(hybrid, **changes)
    return integration.MegatronHybridAttention(config, 1, hybrid_config=hybrid, pg_collection=NO_GROUPS)


@pytest.mark.parametrize("argument", ["rotary_pos_emb", "attention_bias", "inference_context",
                                      "key_value_states", "sequence_len_offset"])
def test_unsupported_megatron_arguments_raise_by_name(argument: str) -> None:
    layer = adapter()
    x = torch.randn(16, 1, layer.config.hidden_size)
    with pytest.raises(ValueError, match=f"self_attention got {argument}"):
        layer(x, **{argument: torch.zeros(1)})


def test_attention_mask_is_honoured_or_rejected_and_bias_is_none() -> None:
    """Megatron's masks reach the layer: causal = no mask, a document mask splits the documents
    (as two separate calls), a mask the layer cannot honour raises instead of being ignored."""
    layer = adapter().eval()
    x = torch.randn(16, 2, layer.config.hidden_size)
    causal = torch.ones(16, 16, dtype=torch.bool).triu(1)
    out, bias = layer(x, attention_mask=causal.expand(2, 1, 16, 16))
    assert bias is None
    torch.testing.assert_close(out, layer(x)[0], rtol=0, atol=0)
    documents = causal.clone()
    documents[6:, :6] = True
    out, _ = layer(x, attention_mask=documents[None, None])
    torch.testing.assert_close(out, torch.cat((layer(x[:6])[0], layer(x[6:])[0])), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="causal within documents"):
        layer(x, attention_mask=torch.ones(2, 1, 16, 16, dtype=torch.bool))


def test_megatron_packed_seq_params_are_accepted() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams as MegatronPacked

    layer = adapter().eval()
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    x = torch.randn(24, 1, layer.config.hidden_size)
    out, _ = layer(x, packed_seq_params=MegatronPacked(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                       max_seqlen_q=14, max_seqlen_kv=14))
    torch.testing.assert_close(out[:10], layer(x[:10])[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="dynamic context parallelism"):
        layer(x, packed_seq_params=MegatronPacked(qkv_format="thd", cu_seqlens_q=cu, local_cp_size=2))


def test_group_size_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="tensor_model_parallel_size is 2 but the tp process group has 1"):
        adapter(tensor_model_parallel_size=2)


def test_pattern_kind_selects_the_core_and_megatron_tp_attributes() -> None:
    layer = adapter("M")
    assert layer.kind is LayerKind.MLA and layer.core is DENSE_MLA and not hasattr(layer, "core_attention")
    assert layer.linear_q_up_proj.weight.tensor_model_parallel and layer.linear_q_up_proj.weight.partition_dim == 0
    assert not layer.linear_q_down_proj.weight.tensor_model_parallel


def test_spec_rejects_a_fused_input_norm_and_rotary_position_embedding() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    base = get_gpt_layer_local_spec(normalization="RMSNorm")
    fused = dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, input_layernorm=IdentityOp))
    with pytest.raises(ValueError, match="has no input_layernorm"):
        integration.hybrid_layer_spec(tiny("C"), fused)
    config, overrides = megatron_config(tiny("C"))
    with pytest.raises(ValueError, match="position_embedding_type must be 'none'"):
        integration.hybrid_gpt_model(config, VOCAB, SEQ, gpt_kwargs={"position_embedding_type": "rope"},
                                     **overrides)


def test_indexer_loss_scale_follows_megatron_rule() -> None:
    assert integration.indexer_loss_scale(4, cp_size=2, loss_scale=8.0) == 4.0
    assert integration.indexer_loss_scale(4, cp_size=2, calculate_per_token_loss=True, loss_scale=8.0) == 8.0
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        integration.indexer_loss_scale(0)
    with pytest.raises(ValueError, match="indexer loss scale must be a non-negative float"):
        integration.set_indexer_loss_scale(-1.0)
