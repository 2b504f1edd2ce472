"""A layer kind is one row of `layers.kinds.KINDS` plus its core.

The toy kind `X` below is the whole of what a new kind takes: a C-like kind whose compressor pools 16
tokens (not overlapping) and whose indexer picks among those entries, built on the existing sparse
core. It is checked against an independent construction (an H layer at its ratio, which attends every
visible entry: the same thing when the indexer's top-k covers every entry), against itself split over
two context-parallel ranks (the halo comes from its row), and for its parameter names and shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from megatron_dsa import HybridAttention, HybridAttentionConfig, LayerKind
from megatron_dsa.layers.cores import SPARSE_MLA
from megatron_dsa.layers.kinds import KINDS, KindSpec, build_attention, compressed_rope_table, window_and_groups_halo
from megatron_dsa.parallel import initialize_parallel_state
from megatron_dsa.parallel.context import shard_sequence
from megatron_dsa.parallel.sharding import load_full_state_dict

TOY_RATIO = 16


def toy_ratio(config: HybridAttentionConfig) -> int:
    return TOY_RATIO


def always(config: HybridAttentionConfig) -> bool:
    return True


TOY = KindSpec("X", toy_ratio, always, compressed_rope_table, window_and_groups_halo, SPARSE_MLA)


def config(**overrides) -> HybridAttentionConfig:
    values = dict(num_layers=1, layer_pattern="H", hca_compress_ratio=TOY_RATIO, csa_window_size=4,
                  dsa_indexer_topk=8, dsa_indexer_loss_coeff=0.5)
    return HybridAttentionConfig.from_preset("tiny", **{**values, **overrides})


def test_the_toy_row_builds_a_layer_with_the_indexed_kinds_parameter_names() -> None:
    cfg = config()
    toy = build_attention(cfg, kind=TOY)
    assert isinstance(toy, HybridAttention) and toy.kind == "X" and toy.core is SPARSE_MLA
    csa = HybridAttention(cfg, kind="C")
    assert [name for name, _ in toy.named_parameters()] == [name for name, _ in csa.named_parameters()]
    di, dv = cfg.dsa_indexer_head_dim, cfg.v_head_dim
    shapes = {name: tuple(p.shape) for name, p in toy.named_parameters()}
    # Ratio 16 pools without overlap: one channel block, 16 position embeddings (C's are 2 blocks, 4).
    assert shapes["core_attention.compressor.ape"] == (TOY_RATIO, dv)
    assert shapes["core_attention.indexer.compressor.ape"] == (TOY_RATIO, di)
    assert torch.equal(toy.rotary_inv_freq, csa.rotary_inv_freq)


def test_the_toy_kind_trains_every_parameter() -> None:
    torch.manual_seed(0)
    layer = HybridAttention(config(dsa_indexer_topk=2), kind=TOY).train()
    x = torch.randn(40, 2, layer.config.hidden_size, requires_grad=True)
    out, _ = layer(x)
    out.square().mean().backward()
    assert torch.isfinite(out).all() and layer.last_indexer_loss is not None
    picks = layer.core_attention.last_selection.entries
    assert picks.shape == (80, 2) and int(picks.max()) < 40 // TOY_RATIO
    for name, param in layer.named_parameters():
        if name != "core_attention.attn_sink":  # zero-initialised sink: its gradient may be anything
            assert param.grad is not None and torch.isfinite(param.grad).all(), name
            assert param.grad.abs().sum() > 0, f"{name} got no gradient"


def test_the_toy_kind_picking_every_entry_equals_hca_at_its_ratio() -> None:
    """With a top-k wider than the visible entries the indexer picks them all: the layer is then an H
    layer at its ratio (same parameters but the indexer's), which takes no indexer path at all."""
    cfg = config()
    torch.manual_seed(1)
    toy = HybridAttention(cfg, kind=TOY).double().eval()
    with torch.no_grad():
        toy.core_attention.attn_sink.normal_()
    hca = HybridAttention(cfg, kind="H").double().eval()
    hca.load_state_dict({k: v for k, v in toy.state_dict().items() if ".indexer." not in k})
    x = torch.randn(40, 2, cfg.hidden_size, dtype=torch.float64)
    outputs, grads = [], []
    for layer in (toy, hca):
        inputs = x.clone().requires_grad_()
        out, _ = layer(inputs)
        out.square().sum().backward()
        outputs.append(out)
        grads.append(inputs.grad)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)


def toy_context_parallel_body(rank: int, world: int) -> None:
    """CP-2 == CP-1 for the toy kind: its halo comes from its row (`r − 1 = 15` rows, more than the
    window's `W − 1 = 3` and longer than a zigzag piece of 12 rows)."""
    state = initialize_parallel_state(cp_size=world)
    cfg = config(dsa_indexer_topk=2)
    torch.manual_seed(3)
    reference = HybridAttention(cfg, kind=TOY).double()
    hidden = torch.randn(48, 2, cfg.hidden_size, dtype=torch.float64)
    upstream = torch.randn_like(hidden)
    x = hidden.clone().requires_grad_()
    out, _ = reference(x)
    (out * upstream).sum().backward()

    layer = HybridAttention(cfg, kind=TOY, parallel_state=state).double()
    load_full_state_dict(layer, reference.state_dict(), state)
    mine = lambda t: shard_sequence(t, world, rank, cfg.cp_partition)  # noqa: E731
    x_local = mine(hidden).clone().requires_grad_()
    out_local, _ = layer(x_local)
    (out_local * mine(upstream)).sum().backward()
    torch.testing.assert_close(out_local, mine(out), rtol=0, atol=1e-12)
    torch.testing.assert_close(x_local.grad, mine(x.grad), rtol=0, atol=1e-12)
    expected = dict(reference.named_parameters())
    for name, param in layer.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=state.cp_group)
        torch.testing.assert_close(grad, expected[name].grad, rtol=0, atol=1e-12, msg=name)
    loss = layer.last_indexer_loss.clone()
    dist.all_reduce(loss, group=state.cp_group)
    torch.testing.assert_close(loss, reference.last_indexer_loss, rtol=0, atol=1e-12)


def test_the_toy_kind_under_context_parallelism_equals_one_process() -> None:
    assert TOY.context_halo(config()) == TOY_RATIO - 1
    run_distributed(toy_context_parallel_body, 2)


def test_every_pattern_letter_has_a_row() -> None:
    assert sorted(KINDS) == sorted(kind.value for kind in LayerKind)
    assert all(KINDS[kind.value].kind is kind for kind in LayerKind)


def test_a_row_that_does_not_fit_its_core_or_the_pattern_is_rejected() -> None:
    no_compressor = KindSpec("Y", lambda c: 0, always, compressed_rope_table, window_and_groups_halo, SPARSE_MLA)
    with pytest.raises(ValueError, match="kind 'Y' has an indexer but no compressor"):
        HybridAttention(config(), kind=no_compressor)
    with pytest.raises(ValueError, match=r"kind 'X' conflicts with layer_pattern\[1\] = 'H'"):
        HybridAttention(config(), layer_number=1, kind=TOY)
