"""TP initialisation: the shards of a TP = N build are the slices of an independent TP = 1 build.

The TP = 1 layer (or model) is built separately from the same seed, never copied from the TP = N
one, so drawing each rank's block from the same-seeded generator (every rank gets the same values:
duplicated heads) fails here. Checked for every kind and every builder: `HybridAttention(...,
parallel_state=...)`, the main job's `build_model`, and Megatron's `GPTModel` with our layer spec.
Values are compared exactly: both sides make the same RNG draws.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_distributed
from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.parallel import initialize_parallel_state
from megatron_dsa.parallel.sharding import partition_dims

SEED = 11


def small_config(pattern: str, **overrides) -> HybridAttentionConfig:
    values = dict(num_layers=len(pattern), layer_pattern=pattern, csa_window_size=8, hca_compress_ratio=8,
                  dsa_indexer_topk=3, o_groups=4, num_query_groups=4)
    return HybridAttentionConfig.from_preset("tiny", **{**values, **overrides})


def assert_shards_are_slices(sharded: nn.Module, whole: nn.Module, dims: dict, tag: str) -> None:
    """Each split parameter is this rank's block of `whole`'s, each replicated one equals it, and
    split blocks differ between ranks (a same-seeded local draw would make them equal)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    expected = dict(whole.named_parameters())
    assert set(expected) == {name for name, _ in sharded.named_parameters()}, tag
    for name, param in sharded.named_parameters():
        dim, full = dims[name], expected[name].detach()
        block = full if dim is None else full.chunk(world, dim=dim)[rank]
        assert torch.equal(param.detach(), block), f"{tag} {name} (split dim {dim}): not the TP = 1 slice"
        if dim is not None and bool(full.abs().sum() > 0):
            parts = [torch.empty_like(param) for _ in range(world)]
            dist.all_gather(parts, param.detach().contiguous())
            assert not torch.equal(parts[0], parts[1]), f"{tag} {name}: identical on every TP rank"


def layer_body(rank: int, world: int) -> None:
    state = initialize_parallel_state(tp_size=world)
    for kind in "WCHM":
        for sequence_parallel in (False, True):
            config = small_config(kind, sequence_parallel=sequence_parallel)
            torch.manual_seed(SEED)
            sharded = HybridAttention(config, kind=kind, parallel_state=state)
            torch.manual_seed(SEED)
            whole = HybridAttention(config.replace(sequence_parallel=False), kind=kind)
            assert_shards_are_slices(sharded, whole, partition_dims(sharded), f"kind {kind} sp={sequence_parallel}")


def train_builder_body(rank: int, world: int) -> None:
    from megatron_dsa.model import ModelConfig
    from megatron_dsa.train import JobConfig, TrainConfig, build_model

    state = initialize_parallel_state(tp_size=world)
    job = JobConfig(small_config("WCHM"), ModelConfig(ffn_hidden_size=64, max_seq_len=64),
                    TrainConfig(seq_len=64, seed=SEED, retrieval_pairs=2, retrieval_queries=2))
    sharded = build_model(job, torch.device("cpu"), state)
    whole = build_model(job, torch.device("cpu"))
    assert_shards_are_slices(sharded, whole, partition_dims(sharded), "train.build_model")


def test_layer_shards_are_slices_of_the_tp1_layer() -> None:
    run_distributed(layer_body, 2)


def test_main_job_model_shards_are_slices_of_the_tp1_model() -> None:
    run_distributed(train_builder_body, 2)


def megatron_body(rank: int, world: int, pattern: str) -> None:
    from megatron.core import parallel_state

    from test_megatron_integration import megatron_config, tiny
    from megatron_dsa.integrations.megatron import hybrid_gpt_model

    def build(tp: int) -> dict[str, nn.Module]:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        hybrid = tiny(pattern)
        config, overrides = megatron_config(hybrid, tensor_model_parallel_size=tp)
        torch.manual_seed(SEED)
        model = hybrid_gpt_model(config, 64, 32, **overrides)
        parallel_state.destroy_model_parallel()
        return {f"layer {i + 1}": layer.self_attention for i, layer in enumerate(model.decoder.layers)}

    sharded, whole = build(world), build(1)
    for name, attention in sharded.items():
        assert_shards_are_slices(attention, whole[name], partition_dims(attention), f"GPTModel {name}")


@pytest.mark.parametrize("pattern", ["WCHM"])
def test_megatron_gpt_model_attention_shards_are_slices_of_tp1(pattern: str) -> None:
    pytest.importorskip("megatron.core", reason='megatron-core is not installed (pip install -e ".[megatron]")')
    run_distributed(megatron_body, 2, pattern)
