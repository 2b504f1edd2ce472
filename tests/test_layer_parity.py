"""Whole-layer parity: every kind (W / C / H / M) in float64 against the independent reference.

Compares the output, the input gradient, every parameter gradient, the indexer loss value and the
indexer's top-k selection. Tolerance (fp64 vs fp64): max |a − b| ≤ 1e-10 · max(‖expected‖∞, 1e-6)
(`reference_layer.FP64_TOLERANCE`); observed errors are ~1e-15.

Shapes: S = 70, B = 2, W = 8; C layers (r = 4) have 17 entries with top-k 5, so window, compressed
entries, the uncompressed tail and top-k truncation all matter; H layers use r = 8 and r = 16; two
cases use S = 64, an exact multiple of the ratio, and one a top-k above the number of entries.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from reference_layer import assert_fp64_close, leaf_parameters, randomize_parameters_, reference_layer

SEQLEN, BATCH = 70, 2
BASE = dict(csa_window_size=8, hca_compress_ratio=8, dsa_indexer_topk=5, dsa_indexer_n_heads=8,
            dsa_indexer_loss_coeff=0.1)
INDEXER_PREFIX = "core_attention.indexer."

CASES = {
    "W": ("W", {}),
    "W-window-above-S": ("W", dict(csa_window_size=128)),
    "W-single-token": ("W", {}),
    "C-sparse-mean": ("C", dict(dsa_indexer_use_sparse_loss=True, calculate_per_token_loss=False)),
    "C-sparse-per-token": ("C", dict(dsa_indexer_use_sparse_loss=True, calculate_per_token_loss=True)),
    "C-dense-mean": ("C", dict(dsa_indexer_use_sparse_loss=False, calculate_per_token_loss=False)),
    "C-dense-per-token": ("C", dict(dsa_indexer_use_sparse_loss=False, calculate_per_token_loss=True)),
    "C-csa-dense-mode": ("C", dict(csa_dense_mode=True)),
    "C-no-qk-layernorm": ("C", dict(qk_layernorm=False)),
    "H-r8": ("H", dict(hca_compress_ratio=8)),
    "H-r16": ("H", dict(hca_compress_ratio=16)),
    "H-r16-exact-multiple": ("H", dict(hca_compress_ratio=16)),
    "C-topk-above-entries": ("C", dict(dsa_indexer_topk=64)),
    "C-exact-multiple": ("C", dict(dsa_indexer_topk=6)),
    "M-mha-yarn": ("M", dict(rope_type="yarn")),
    "M-gqa-yarn-mscale": ("M", dict(rope_type="yarn", num_query_groups=2, qk_head_dim=16, kv_lora_rank=24,
                                    mscale=0.9, mscale_all_dim=0.7)),
    "M-gqa-plain-rope": ("M", dict(rope_type="rope", num_query_groups=1, qk_head_dim=40)),
    "M-no-qk-layernorm": ("M", dict(qk_layernorm=False, num_query_groups=2)),
    "M-single-token": ("M", dict(num_query_groups=2)),
}
# Cases with another sequence length: exact multiples of the ratio (no uncompressed tail), one token.
CASE_SEQLEN = {"C-exact-multiple": 64, "H-r16-exact-multiple": 64, "W-single-token": 1, "M-single-token": 1}


def make_config(**overrides) -> HybridAttentionConfig:
    return HybridAttentionConfig.from_preset("tiny", **{**BASE, **overrides})


def make_layer(config: HybridAttentionConfig, kind: str, seed: int = 0,
               dtype: torch.dtype = torch.float64) -> HybridAttention:
    layer = HybridAttention(config, kind=kind).to(dtype)  # built in float32, upcast for fp64 tests
    randomize_parameters_(layer, seed)
    return layer.train()


def inputs(config: HybridAttentionConfig, seqlen: int = SEQLEN, batch: int = BATCH, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seqlen, batch, config.hidden_size, generator=gen, dtype=torch.float64)
    upstream = torch.randn(seqlen, batch, config.hidden_size, generator=gen, dtype=torch.float64)
    return x, upstream


def run_layer(layer: HybridAttention, x: torch.Tensor, upstream: torch.Tensor):
    """Forward + backward of `(out · upstream).sum()`; returns (out, input grad, {name: grad})."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    out.backward(upstream)
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def run_reference(layer: HybridAttention, kind: str, x: torch.Tensor, upstream: torch.Tensor):
    """Reference forward and the gradients of `(out · upstream).sum() + backward_scale · loss`."""
    params = leaf_parameters(layer)
    x = x.clone().requires_grad_()
    result = reference_layer(params, layer.config, kind, x)
    objective = (result.out * upstream).sum()
    if result.indexer_loss is not None:
        objective = objective + layer.config.indexer_loss_backward_scale * result.indexer_loss
    names = list(params)
    grads = torch.autograd.grad(objective, [x] + [params[n] for n in names], allow_unused=True)
    param_grads = {n: (g if g is not None else torch.zeros_like(params[n])) for n, g in zip(names, grads[1:])}
    return result, grads[0], param_grads


def package_selection(layer: HybridAttention, batch: int, seqlen: int) -> list[list[list[int]]]:
    """The layer's last top-k as compressed entry numbers `j`, per batch element and token.

    Rows of `kv_full` are `[B·S token rows ; compressed rows]` with sequence `b`'s entries starting
    at `B·S + b·C` (`ops/indices.py`)."""
    chosen = layer.core_attention.last_selection.compressed
    entries = seqlen // layer.core_attention.ratio
    table = []
    for b in range(batch):
        rows = []
        for t in range(seqlen):
            ids = chosen[b * seqlen + t].tolist()
            rows.append(sorted(i - batch * seqlen - b * entries for i in ids if i >= 0))
        table.append(rows)
    return table


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_reference(case):
    kind, overrides = CASES[case]
    seqlen = CASE_SEQLEN.get(case, SEQLEN)
    config = make_config(**overrides)
    layer = make_layer(config, kind)
    x, upstream = inputs(config, seqlen)

    out, x_grad, grads = run_layer(layer, x, upstream)
    ref, ref_x_grad, ref_grads = run_reference(layer, kind, x, upstream)

    assert out.dtype == torch.float64 and out.shape == (seqlen, BATCH, config.hidden_size)
    assert_fp64_close(out, ref.out, f"{case}: output")
    assert_fp64_close(x_grad, ref_x_grad, f"{case}: input grad")
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert_fp64_close(grad, ref_grads[name], f"{case}: grad of {name}")

    if ref.indexer_loss is None:
        assert layer.last_indexer_loss is None
    else:
        assert layer.last_indexer_loss is not None, f"{case}: the layer computed no indexer loss"
        assert layer.last_indexer_loss.item() > 0
        assert_fp64_close(layer.last_indexer_loss, ref.indexer_loss, f"{case}: indexer loss")
    if ref.selections is not None:
        expected = [[sorted(row) for row in seq] for seq in ref.selections]
        assert package_selection(layer, BATCH, seqlen) == expected, f"{case}: top-k selection differs"


def test_topk_truncation_is_exercised():
    """Guard on the test setup: some rows select exactly top-k out of more visible entries."""
    config = make_config()
    layer = make_layer(config, "C")
    x, _ = inputs(config)
    ref = reference_layer(leaf_parameters(layer), config, "C", x)
    widths = {len(row) for seq in ref.selections for row in seq}
    assert max(widths) == config.dsa_indexer_topk < SEQLEN // 4
    assert 0 in widths and len(widths) > 2  # early rows: nothing visible, then partial rows


def _split(grads: dict) -> tuple[dict, dict]:
    indexer = {n: g for n, g in grads.items() if n.startswith(INDEXER_PREFIX)}
    main = {n: g for n, g in grads.items() if not n.startswith(INDEXER_PREFIX)}
    return indexer, main


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_zero_upstream_grad_trains_only_the_indexer(sparse):
    """docs/math.md §9: with a zero upstream gradient and coeff > 0 only the indexer learns, and its
    grads equal the reference gradient of the KL loss."""
    config = make_config(dsa_indexer_use_sparse_loss=sparse)
    layer = make_layer(config, "C")
    x, _ = inputs(config)
    zero = torch.zeros_like(x)
    _, x_grad, grads = run_layer(layer, x, zero)
    _, ref_x_grad, ref_grads = run_reference(layer, "C", x, zero)

    indexer, main = _split(grads)
    assert len(indexer) == 6
    assert torch.equal(x_grad, torch.zeros_like(x_grad)), "the indexer loss leaked into the input grad"
    for name, grad in main.items():
        assert grad is not None and torch.equal(grad, torch.zeros_like(grad)), \
            f"the indexer loss leaked into {name}"
    for name, grad in indexer.items():
        assert grad is not None and grad.abs().max() > 0, f"indexer param {name} got no KL gradient"
        assert_fp64_close(grad, ref_grads[name], f"KL grad of {name}")
    assert torch.equal(ref_x_grad, torch.zeros_like(ref_x_grad))


def test_zero_coefficient_gives_exact_zero_indexer_grads():
    """docs/math.md §9 / bug A1.5: coeff = 0 ⇒ indexer grads exist and are exactly zero, and every other
    gradient equals both a coeff > 0 run and a run without any indexer loss (eval mode)."""
    x, upstream = inputs(make_config())
    zero_coeff = make_layer(make_config(dsa_indexer_loss_coeff=0.0), "C")
    with_coeff = make_layer(make_config(dsa_indexer_loss_coeff=0.3), "C")

    out0, x_grad0, grads0 = run_layer(zero_coeff, x, upstream)
    assert zero_coeff.last_indexer_loss is not None and zero_coeff.last_indexer_loss.item() == 0.0
    indexer0, main0 = _split(grads0)
    for name, grad in indexer0.items():
        assert grad is not None, f"coeff=0 left {name}.grad None (DDP needs every grad)"
        assert torch.equal(grad, torch.zeros_like(grad)), f"coeff=0 gave a nonzero grad for {name}"

    out1, x_grad1, grads1 = run_layer(with_coeff, x, upstream)
    no_loss = make_layer(make_config(dsa_indexer_loss_coeff=0.3), "C").eval()
    out2, x_grad2, grads2 = run_layer(no_loss, x, upstream)
    assert no_loss.last_indexer_loss is None
    for other_out, other_x_grad, other_grads in ((out1, x_grad1, grads1), (out2, x_grad2, grads2)):
        assert torch.equal(out0, other_out)
        assert torch.equal(x_grad0, other_x_grad)
        for name, grad in _split(other_grads)[1].items():
            assert torch.equal(main0[name], grad), f"{name} depends on the indexer loss"

    _, ref_x_grad, ref_grads = run_reference(zero_coeff, "C", x, upstream)
    assert_fp64_close(x_grad0, ref_x_grad, "input grad")
    for name, grad in main0.items():
        assert_fp64_close(grad, ref_grads[name], f"grad of {name}")


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_per_token_loss_is_row_count_times_mean(sparse):
    """Bug A2.2: per-token loss = B·S × mean loss, and the same factor on the indexer grads."""
    x, _ = inputs(make_config())
    zero = torch.zeros_like(x)
    results = {}
    for per_token in (False, True):
        layer = make_layer(make_config(dsa_indexer_use_sparse_loss=sparse, calculate_per_token_loss=per_token), "C")
        _, _, grads = run_layer(layer, x, zero)
        results[per_token] = (layer.last_indexer_loss, _split(grads)[0])
    rows = SEQLEN * BATCH
    assert_fp64_close(results[True][0], rows * results[False][0], "per-token loss")
    for name, grad in results[True][1].items():
        assert_fp64_close(grad, rows * results[False][1][name], f"per-token grad of {name}")


def test_dense_and_sparse_loss_differ():
    """Negative control: the two loss modes really use different candidate sets here."""
    x, _ = inputs(make_config())
    losses = []
    for sparse in (True, False):
        layer = make_layer(make_config(dsa_indexer_use_sparse_loss=sparse), "C")
        layer(x)
        losses.append(layer.last_indexer_loss.item())
    assert abs(losses[0] - losses[1]) > 1e-6 * abs(losses[1])


def test_csa_dense_mode_attends_every_visible_entry():
    """csa_dense_mode: no indexer, each row's compressed set is every visible entry (like H)."""
    config = make_config(csa_dense_mode=True)
    layer = make_layer(config, "C")
    assert layer.core_attention.indexer is None
    assert not any(n.startswith(INDEXER_PREFIX) for n, _ in layer.named_parameters())
    x, _ = inputs(config)
    layer(x)
    table = package_selection(layer, BATCH, SEQLEN)
    for seq in table:
        for t, row in enumerate(seq):
            assert row == list(range((t + 1) // 4)), f"row {t}"
