"""A layer kind is one row of the kind table (`config.KINDS`, filled by `layers.kinds`) plus its core.

The toy kind `X` below is the whole of what a new kind takes: a C-like kind whose compressor pools 16
tokens (not overlapping) and whose indexer picks among those entries, built on the existing sparse
core. It is checked against an independent construction (an H layer at its ratio, which attends every
visible entry: the same thing when the indexer's top-k covers every entry), against itself split over
two context-parallel ranks (the halo comes from its row), and for its parameter names and shapes.
Registered (`register_kind`, one row, nothing else touched) it is a letter of `layer_pattern` that the
config, the layers, a model, the Megatron translation and `megatron-dsa info` all know.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from megatron_dsa import HybridAttention, HybridAttentionConfig, LayerKind
from megatron_dsa.__main__ import describe_info
from megatron_dsa.integrations.megatron_config import (DSV4_FIELDS, SHARED_FIELDS, hybrid_config_from_megatron,
                                                       to_megatron_kwargs)
from megatron_dsa.layers.cores import SPARSE_MLA
from megatron_dsa.layers.kinds import (KINDS, KindSpec, build_attention, compressed_rope_table, register_kind,
                                       window_and_groups_halo)
from megatron_dsa.model import HybridLM, ModelConfig
from megatron_dsa.parallel import initialize_parallel_state
from megatron_dsa.parallel.context import shard_sequence
from megatron_dsa.parallel.sharding import load_full_state_dict

TOY_RATIO = 16


def always(config: HybridAttentionConfig) -> bool:
    return True


TOY = KindSpec("X", "toy", TOY_RATIO, always, compressed_rope_table, window_and_groups_halo, SPARSE_MLA)


@pytest.fixture
def registered_toy() -> Iterator[KindSpec]:
    """TOY as a row of the table for one test (registered: its one line; then taken out again)."""
    register_kind(TOY)
    yield TOY
    del KINDS[TOY.symbol]


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


def test_the_package_kinds_are_the_rows_layer_kind_names() -> None:
    assert list(KINDS) == [kind.value for kind in LayerKind] == list("WCHM")
    assert all(KINDS[kind.value].kind is kind for kind in LayerKind)
    c = config(num_layers=4, layer_pattern="WCHM", hca_compress_ratio=32)
    assert c.csa_compress_ratios == [0, 4, 32, 0]
    assert [c.has_indexer(kind) for kind in "WCHM"] == [False, True, False, False]
    assert not c.replace(csa_dense_mode=True).has_indexer(LayerKind.CSA)


def test_a_registered_toy_kind_is_a_pattern_letter_everywhere(registered_toy: KindSpec) -> None:
    """One `register_kind` row: the config takes its letter, a model of that pattern builds and trains,
    the Megatron translation carries it as layer_pattern (a ratio list cannot name it) and info lists it."""
    cfg = config(num_layers=3, layer_pattern="wxc")
    assert cfg.layer_pattern == "WXC" and cfg.layer_kind(2) == "X" and cfg.csa_compress_ratios == [0, TOY_RATIO, 4]
    assert cfg.compress_ratio("X") == TOY_RATIO and cfg.has_indexer("X")
    with pytest.raises(ValueError, match=r"'Q' at position 0 is not one of W \(window\), .*, X \(toy\)"):
        config(layer_pattern="Q")

    torch.manual_seed(0)
    model = HybridLM(cfg, ModelConfig(vocab_size=32, ffn_hidden_size=16, max_seq_len=64))
    toy_layer = model.layers[1].self_attention
    assert toy_layer.kind_spec is TOY and toy_layer.core_attention.compressor.ratio == TOY_RATIO
    logits = model(torch.randint(0, 32, (2, 40)))
    logits.square().mean().backward()
    assert torch.isfinite(logits).all() and toy_layer.linear_kv_proj.weight.grad.abs().sum() > 0
    assert set(model.indexer_losses()) == {2, 3}  # the toy layer's indexer and the C layer's

    kwargs, overrides = to_megatron_kwargs(cfg, {"csa_compress_ratios", *SHARED_FIELDS, *DSV4_FIELDS})
    assert "csa_compress_ratios" not in kwargs and overrides["layer_pattern"] == "WXC"
    back = hybrid_config_from_megatron(SimpleNamespace(**kwargs), **overrides)
    assert back.replace(qk_head_dim=None, kv_lora_rank=None, num_query_groups=None) == cfg  # M dims: given there

    assert re.search(rf"^  X +toy +{TOY_RATIO} +SparseMLACore$", describe_info(), re.M)


def test_a_kind_is_a_pattern_letter_only_while_registered() -> None:
    with pytest.raises(ValueError, match=r"'X' at position 1 is not one of W \(window\), C \(CSA\), H \(HCA\), "
                                         r"M \(dense MLA\)$"):
        config(num_layers=2, layer_pattern="WX")
    with pytest.raises(ValueError, match="layer kind must be one of .*, got 'X'"):
        config().compress_ratio("X")


@pytest.mark.parametrize("row, message", [
    (TOY.__class__(**{**vars(TOY), "symbol": "C"}), r"kind 'C' is already registered \(CSA\)"),
    (TOY.__class__(**{**vars(TOY), "symbol": "x"}), "symbol must be one upper-case ASCII letter, got 'x'"),
    (TOY.__class__(**{**vars(TOY), "ratio": -1}), "kind 'X': ratio must be an int >= 0 or a config field name"),
    (TOY.__class__(**{**vars(TOY), "ratio": "csa_dense_mode"}), "'csa_dense_mode' is not an int field"),
    (TOY.__class__(**{**vars(TOY), "ratio": 4, "named_by_ratio": True}), "kinds 'C' and 'X' would both be named"),
    (TOY.__class__(**{**vars(TOY), "ratio": "csa_window_size", "named_by_ratio": True}),
     "kinds 'H' and 'X' would both be named"),
])
def test_register_kind_rejects_a_row_the_table_cannot_take(row: KindSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        register_kind(row)
    assert list(KINDS) == list("WCHM")


def test_a_row_that_does_not_fit_its_core_or_the_pattern_is_rejected() -> None:
    no_compressor = KindSpec("Y", "no compressor", 0, always, compressed_rope_table, window_and_groups_halo,
                             SPARSE_MLA)
    with pytest.raises(ValueError, match="kind 'Y' has an indexer but no compressor"):
        HybridAttention(config(), kind=no_compressor)
    with pytest.raises(ValueError, match=r"kind 'X' conflicts with layer_pattern\[1\] = 'H'"):
        HybridAttention(config(), layer_number=1, kind=TOY)
