"""Whole-layer properties: autograd safety, causality, batching, short sequences, eval path, RoPE
tables per kind, loss plumbing and bf16 — each tied to a spec section or a bug class."""

from __future__ import annotations


import pytest
import torch

from megatron_dsa import HybridAttention
from megatron_dsa.backends import call_counts, reset_call_counts
from reference_layer import (
    assert_fp64_close,
    leaf_parameters,
    plain_inv_freq,
    reference_layer,
    yarn_correction_range,
    yarn_inv_freq,
)
from saved_tensors import SavedTensorGuard
from test_layer_parity import INDEXER_PREFIX, inputs, make_config, make_layer, run_layer

SEQLEN = 48  # 12 groups of 4, 6 of 8, 3 of 16
KIND_CASES = {
    "W": ("W", {}),
    "C-sparse": ("C", dict(dsa_indexer_use_sparse_loss=True)),
    "C-dense-loss": ("C", dict(dsa_indexer_use_sparse_loss=False, calculate_per_token_loss=True)),
    "H-r8": ("H", dict(hca_compress_ratio=8)),
    "H-r16": ("H", dict(hca_compress_ratio=16)),
    "M": ("M", dict(num_query_groups=2, qk_head_dim=16)),
}


def kind_layer(case: str, dtype=torch.float64, seed: int = 0) -> tuple[str, HybridAttention]:
    kind, overrides = KIND_CASES[case]
    return kind, make_layer(make_config(**overrides), kind, seed, dtype)


def all_grads(layer: HybridAttention) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in layer.named_parameters()}


# ------------------------------------------------------------------------------ A1.1 saved tensors
@pytest.mark.parametrize("case", list(KIND_CASES))
def test_saved_tensors_are_not_mutated(case):
    _, layer = kind_layer(case)
    x, upstream = inputs(layer.config, SEQLEN)
    x.requires_grad_()
    with SavedTensorGuard().watching() as guard:
        out, _ = layer(x)
        out.backward(upstream)
    assert guard.packed > 0 and guard.unpacked > 0
    assert torch.isfinite(x.grad).all()


# ------------------------------------------------------------------------------ A3.5 leakage
PROBE_POSITIONS = [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 47]  # incl. every group edge


@pytest.mark.parametrize("case", list(KIND_CASES))
def test_future_tokens_do_not_leak(case):
    """Perturbing tokens at positions >= p leaves every output at positions < p bitwise unchanged,
    in particular when p sits on a compression-group boundary (fp32, training forward)."""
    _, layer = kind_layer(case, dtype=torch.float32)
    x, _ = inputs(layer.config, SEQLEN)
    x = x.float()
    base = layer(x)[0]
    gen = torch.Generator().manual_seed(7)
    for p in PROBE_POSITIONS:
        changed = x.clone()
        changed[p:] += 3.0 * torch.randn(changed[p:].shape, generator=gen)
        out = layer(changed)[0]
        assert torch.equal(out[:p], base[:p]), f"{case}: tokens >= {p} changed outputs before {p}"
        assert not torch.equal(out[p:], base[p:]), "probe had no effect"


@pytest.mark.parametrize("case", list(KIND_CASES))
def test_sequences_in_a_batch_do_not_mix(case):
    _, layer = kind_layer(case, dtype=torch.float32)
    x, _ = inputs(layer.config, SEQLEN, batch=3)
    x = x.float()
    base = layer(x)[0]
    changed = x.clone()
    changed[:, 1] = torch.randn(changed[:, 1].shape)
    out = layer(changed)[0]
    assert torch.equal(out[:, 0], base[:, 0]) and torch.equal(out[:, 2], base[:, 2])


# ------------------------------------------------------------------------------ batching
@pytest.mark.parametrize("case", list(KIND_CASES))
def test_batch_equals_loop_of_single_sequences(case):
    kind, layer = kind_layer(case)
    batch = 3
    x, upstream = inputs(layer.config, SEQLEN, batch=batch)
    out, x_grad, grads = run_layer(layer, x, upstream)
    batch_loss = layer.last_indexer_loss

    singles = [run_layer(layer, x[:, b:b + 1], upstream[:, b:b + 1]) + (layer.last_indexer_loss,)
               for b in range(batch)]
    for b, (out_b, x_grad_b, _, _) in enumerate(singles):
        assert_fp64_close(out[:, b:b + 1], out_b, f"output of sequence {b}")
        assert_fp64_close(x_grad[:, b:b + 1], x_grad_b, f"input grad of sequence {b}")
    per_token = layer.config.calculate_per_token_loss
    indexer_weight = 1.0 if per_token else 1.0 / batch  # mean over B·S rows vs S rows per single run
    for name, grad in grads.items():
        parts = [single[2][name] for single in singles]
        weight = indexer_weight if name.startswith(INDEXER_PREFIX) else 1.0
        assert_fp64_close(grad, weight * sum(parts), f"grad of {name}")
    if batch_loss is None:
        assert all(single[3] is None for single in singles)
    else:
        assert_fp64_close(batch_loss, indexer_weight * sum(single[3] for single in singles), "indexer loss")


# ------------------------------------------------------------------------------ short sequences
COMPRESSOR_PREFIXES = ("core_attention.compressor.", INDEXER_PREFIX)


@pytest.mark.parametrize("case,seqlen", [("C-sparse", 1), ("C-sparse", 3), ("C-dense-loss", 3),
                                         ("H-r8", 7), ("H-r16", 5), ("H-r16", 15)])
def test_sequence_shorter_than_ratio_is_window_only(case, seqlen):
    """S < r: no compressed entry, window-only attention (equal to the reference), no NaN, and the
    compressor / indexer parameters get exact-zero gradients, not None (docs/math.md §9, DDP)."""
    kind, layer = kind_layer(case)
    x, upstream = inputs(layer.config, seqlen)
    out, x_grad, grads = run_layer(layer, x, upstream)
    params = leaf_parameters(layer)
    xr = x.clone().requires_grad_()
    ref = reference_layer(params, layer.config, kind, xr)
    assert_fp64_close(out, ref.out, "output")
    ref_x_grad, = torch.autograd.grad((ref.out * upstream).sum(), xr)
    assert_fp64_close(x_grad, ref_x_grad, "input grad")
    if layer.last_indexer_loss is not None:
        assert layer.last_indexer_loss.item() == 0.0
    zero_grad_names = [n for n in grads if n.startswith(COMPRESSOR_PREFIXES)]
    assert zero_grad_names
    for name in zero_grad_names:
        grad = grads[name]
        assert grad is not None, f"{name}.grad is None for S={seqlen} < r"
        assert torch.equal(grad, torch.zeros_like(grad)), f"{name}.grad is not exactly zero"
    for name, grad in grads.items():
        assert grad is not None and torch.isfinite(grad).all(), name


# ------------------------------------------------------------------------------ eval / no-grad
def _loss_calls() -> int:
    """Calls of the indexer-loss op (teacher attention mass + KL) since the last reset."""
    return sum(n for (_, op), n in call_counts().items() if op == "indexer_loss")


@pytest.mark.parametrize("mode", ["eval", "no_grad", "eval+no_grad", "inference_mode"])
def test_eval_selects_training_topk_and_skips_the_loss(mode):
    """docs/math.md §9 / A1.5 mirror: the no-grad path picks the same top-k and never computes the KL."""
    _, layer = kind_layer("C-sparse")
    x, _ = inputs(layer.config, SEQLEN)
    reset_call_counts()
    train_out = layer(x)[0]
    train_selection = layer.core_attention.last_selection
    assert layer.last_indexer_loss is not None
    assert _loss_calls() > 0, "positive control: training computes the loss"

    reset_call_counts()
    if "eval" in mode:
        layer.eval()
    if mode == "inference_mode":
        context = torch.inference_mode()
    elif "no_grad" in mode:
        context = torch.no_grad()
    else:
        context = torch.enable_grad()
    with context:
        out = layer(x)[0]
    selection = layer.core_attention.last_selection
    assert torch.equal(selection.window, train_selection.window)
    assert torch.equal(selection.compressed, train_selection.compressed)
    assert torch.equal(out, train_out.detach())
    assert layer.last_indexer_loss is None
    assert _loss_calls() == 0, "the indexer loss op (teacher and KL) ran outside training"


# Run in a child process: the package's kept tables (RoPE, Hadamard, device scalars, layouts) are process-wide,
# and in this process earlier tests have built them outside inference mode already.
INFERENCE_THEN_TRAINING = """
import sys

import torch
from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.layers.decoding import LayerCache
from megatron_dsa.packed_seq import PackedSeqParams

backend, device = sys.argv[1], sys.argv[2]
# On the GPU: bf16 at the preset's dims, so the fused backends (and their own caches) serve; H gets one entry.
preset, seqlen, dtype = ("tiny", 24, torch.float32) if device == "cpu" else ("dsv4-flash", 160, torch.bfloat16)


def relative_error(actual, expected):
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


cases = [("W", "native"), ("C", "native"), ("H", "native"), ("M", "native")]
for kind, precision in cases + ([("C", "fp8")] if backend == "auto" else []):  # (no Triton FP8 GEMM)
    torch.manual_seed(0)
    config = HybridAttentionConfig.from_preset(preset, num_layers=1, layer_pattern=kind, projection_precision=precision,
                                               attention_backend=backend)
    layer = HybridAttention(config, kind=kind).to(device, dtype)
    x = torch.randn(seqlen, 2, config.hidden_size, device=device, dtype=dtype)
    packed = x.transpose(0, 1).reshape(2 * seqlen, 1, -1)
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32, device=device),
                             max_seqlen_q=seqlen)
    with torch.inference_mode():  # an evaluation: full, packed, and prefill + decode through a cache
        evaluated = layer(x)[0]
        layer(packed, packed_seq_params=params)
        cache = LayerCache.for_layer(layer, 2, seqlen)
        decoded = torch.cat([layer(x[:seqlen - 4], inference_cache=cache)[0]]
                            + [layer(x[t:t + 1], inference_cache=cache)[0] for t in range(seqlen - 4, seqlen)])
    for inputs, kwargs in ((x, {}), (packed, {"packed_seq_params": params})):
        out = layer(inputs.clone().requires_grad_(), **kwargs)[0]
        out.float().square().sum().backward()
    trained = layer(x)[0]
    if device == "cpu":
        assert torch.equal(trained.detach(), evaluated), kind
        assert (decoded - evaluated).abs().max() < 1e-5, kind
    else:  # bf16: a training forward may take other kernels than inference; decoding's own bounds: test_decoding
        assert relative_error(trained.detach(), evaluated) < 2e-2, (kind, relative_error(trained.detach(), evaluated))
        assert relative_error(decoded, evaluated) < 5e-2, (kind, relative_error(decoded, evaluated))
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None), kind
print("trained after inference mode")
"""


@pytest.mark.parametrize("backend, device", [("auto", "cpu"), ("triton", "cpu"),
                                             pytest.param("auto", "cuda", marks=pytest.mark.gpu)])
def test_training_after_an_evaluation_under_inference_mode(backend, device):
    """An evaluation under `torch.inference_mode()` (full, packed, decoding through a cache; every kind, FP8
    projections too) first, then training steps in the same process: the tables the package keeps are built
    outside inference mode, so the training steps can save them for backward (they failed with "Inference
    tensors cannot be saved for backward"), and the training forward equals the evaluation's. `triton`: the
    fused path's glue and kept values, its kernels in the Triton interpreter; `cuda`: bf16 on the GPU, where
    the fused backends and their own caches serve."""
    import os
    import subprocess
    import sys

    if backend == "triton":
        pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1") if backend == "triton" else None
    result = subprocess.run([sys.executable, "-c", INFERENCE_THEN_TRAINING, backend, device], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0 and "trained after inference mode" in result.stdout, result.stderr[-3000:]


# ------------------------------------------------------------------------------ A4.3 ties
def test_tied_indexer_scores_select_the_lowest_entries():
    """All indexer scores exactly 0 (zero head weights): every row selects its lowest visible entries,
    and the layer still equals the reference (which orders by score, lower index first)."""
    _, layer = kind_layer("C-sparse")
    with torch.no_grad():
        layer.core_attention.indexer.linear_weights_proj.weight.zero_()
    x, upstream = inputs(layer.config, SEQLEN)
    out = run_layer(layer, x, upstream)[0]
    topk = layer.config.dsa_indexer_topk
    ref = reference_layer(leaf_parameters(layer), layer.config, "C", x)
    for seq in ref.selections:
        for t, row in enumerate(seq):
            assert row == list(range(min(topk, (t + 1) // 4))), f"row {t}"
    chosen = layer.core_attention.last_selection.compressed
    entries = SEQLEN // 4
    for b in range(x.shape[1]):
        for t in range(SEQLEN):
            ids = [i for i in chosen[b * SEQLEN + t].tolist() if i >= 0]
            first = x.shape[1] * SEQLEN + b * entries
            assert ids == list(range(first, first + min(topk, (t + 1) // 4))), f"sequence {b}, row {t}"
    assert_fp64_close(out, ref.out, "output")


# ------------------------------------------------------------------------------ RoPE per kind
def test_mscale_and_rope_type_do_not_change_hybrid_layers():
    """A9.2 / docs/math.md §2.5: W/C/H are pure rotations with tables fixed by kind."""
    changed = dict(mscale=0.5, mscale_all_dim=2.0, rope_type="rope", calculate_per_token_loss=False)
    for kind in ("W", "C", "H"):
        layer = make_layer(make_config(), kind)
        other = HybridAttention(make_config(**changed), kind=kind).double().train()
        other.load_state_dict(layer.state_dict(), strict=True)
        assert torch.equal(layer.rotary_inv_freq, other.rotary_inv_freq)
        x, upstream = inputs(layer.config, SEQLEN)
        out, x_grad, grads = run_layer(layer, x, upstream)
        out2, x_grad2, grads2 = run_layer(other, x, upstream)
        assert torch.equal(out, out2) and torch.equal(x_grad, x_grad2), kind
        assert all(torch.equal(grads[n], grads2[n]) for n in grads), kind
        if kind == "C":
            assert torch.equal(layer.last_indexer_loss, other.last_indexer_loss)


def test_mla_does_depend_on_rope_type_and_mscale():
    """Positive control for the test above: the M kind reads rope_type and mscale."""
    x, _ = inputs(make_config(), SEQLEN)
    layer = make_layer(make_config(rope_type="yarn", mscale=1.0, mscale_all_dim=1.0), "M")
    base = layer(x)[0]
    for changed in (dict(rope_type="rope"), dict(mscale=0.5), dict(mscale_all_dim=0.3)):
        other = HybridAttention(make_config(**{"rope_type": "yarn", **changed}), kind="M").double()
        other.load_state_dict(layer.state_dict())
        assert not torch.allclose(other(x)[0], base), changed


def test_rotary_tables_per_kind():
    """W: plain table at rotary_base; C/H: YaRN at csa_compress_rotary_base (docs/math.md §2.3–2.4)."""
    config = make_config(rotary_base=10000.0, csa_compress_rotary_base=40000.0)
    p = config.qk_pos_emb_head_dim
    plain = plain_inv_freq(p, config.rotary_base)
    yarn = yarn_inv_freq(p, config.csa_compress_rotary_base, config.rotary_scaling_factor,
                         config.original_max_position_embeddings, config.beta_fast, config.beta_slow)
    tables = {kind: HybridAttention(config, kind=kind).rotary_inv_freq for kind in "WCH"}
    assert_fp64_close(tables["W"].double(), plain, "W table")
    assert_fp64_close(tables["C"].double(), yarn, "C table")
    assert_fp64_close(tables["H"].double(), yarn, "H table")
    assert not torch.allclose(tables["W"].double(), tables["C"].double())
    wrong_base = yarn_inv_freq(p, config.rotary_base, config.rotary_scaling_factor,
                               config.original_max_position_embeddings, config.beta_fast, config.beta_slow)
    assert not torch.allclose(tables["C"].double(), wrong_base)


@pytest.mark.parametrize("base,low,high", [(40000.0, 17, 28), (160000.0, 15, 25)])
def test_recipe_yarn_table(base, low, high):
    """Recipe values P=64, L0=65536, s=4: correction range from docs/math.md §2.4 and the layer's table."""
    assert yarn_correction_range(64, base, 65536, 32.0, 1.0) == (low, high)
    config = make_config(hidden_size=64, num_attention_heads=2, v_head_dim=128, qk_pos_emb_head_dim=64,
                         o_groups=2, dsa_indexer_head_dim=64, csa_compress_rotary_base=base,
                         original_max_position_embeddings=65536, rotary_scaling_factor=4.0)
    table = HybridAttention(config, kind="H").rotary_inv_freq.double()
    expected = yarn_inv_freq(64, base, 4.0, 65536, 32.0, 1.0)
    assert_fp64_close(table, expected, "YaRN table")
    extrapolated = base ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(table[:low + 1], extrapolated[:low + 1], rtol=1e-14, atol=0)
    assert torch.allclose(table[high:], extrapolated[high:] / 4.0, rtol=1e-14, atol=0)


# ------------------------------------------------------------------------------ loss plumbing
def test_indexer_loss_backward_scale_is_linear():
    """indexer_loss_backward_scale multiplies the KL gradient (and only it); docs/math.md §9."""
    x, upstream = inputs(make_config(), SEQLEN)
    results = {}
    for scale in (1.0, 2.5):
        layer = make_layer(make_config(indexer_loss_backward_scale=scale), "C")
        results[scale] = run_layer(layer, x, upstream) + (layer.last_indexer_loss,)
    (out1, xg1, g1, loss1), (out2, xg2, g2, loss2) = results[1.0], results[2.5]
    assert torch.equal(out1, out2) and torch.equal(xg1, xg2) and torch.equal(loss1, loss2)
    for name in g1:
        if name.startswith(INDEXER_PREFIX):
            assert g1[name].abs().max() > 0
            assert_fp64_close(g2[name], 2.5 * g1[name], f"scaled grad of {name}")
        else:
            assert torch.equal(g1[name], g2[name]), name


# ------------------------------------------------------------------------------ A1.2 reuse
@pytest.mark.parametrize("case", list(KIND_CASES))
def test_repeated_forwards_then_one_backward(case):
    """out1 = f(x); out2 = f(x); (out1² + out2²).sum().backward() gives twice the single-call grads."""
    _, layer = kind_layer(case)
    x, _ = inputs(layer.config, SEQLEN)

    layer.zero_grad(set_to_none=True)
    x1 = x.clone().requires_grad_()
    (layer(x1)[0] ** 2).sum().backward()
    single = all_grads(layer)

    layer.zero_grad(set_to_none=True)
    x2 = x.clone().requires_grad_()
    out1, out2 = layer(x2)[0], layer(x2)[0]
    (out1 ** 2 + out2 ** 2).sum().backward()
    assert_fp64_close(x2.grad, 2 * x1.grad, "input grad")
    for name, grad in all_grads(layer).items():
        assert_fp64_close(grad, 2 * single[name], f"grad of {name}")


# ------------------------------------------------------------------------------ bf16
def _similarities(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Cosine and "tensor similarity" `2<a,b> / (|a|² + |b|²)` (also sensitive to a scale error)."""
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item(), (2 * a @ b / (a @ a + b @ b)).item()


@pytest.mark.parametrize("case", list(KIND_CASES))
def test_bf16_forward_backward_is_finite_and_close(case):
    """bf16 layer: attn_sink / ape stay float32 with their values, fwd+bwd finite, output close to
    the fp64 layer with the same weights (cosine and tensor similarity > 0.99)."""
    kind, fp64 = kind_layer(case)
    layer = HybridAttention(fp64.config, kind=kind)  # built in float32, as in training
    layer.load_state_dict(fp64.state_dict())
    fp32_values = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer = layer.bfloat16()
    for name, param in layer.named_parameters():
        if name.endswith(("attn_sink", "ape")):
            assert param.dtype == torch.float32, name
            assert torch.equal(param, fp32_values[name]), f"{name} lost precision"
        else:
            assert param.dtype == torch.bfloat16, name

    x, upstream = inputs(layer.config, SEQLEN)
    xb = x.bfloat16().requires_grad_()
    out, _ = layer(xb)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.backward(upstream.bfloat16())
    assert torch.isfinite(xb.grad).all()
    for name, param in layer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.dtype == param.dtype, name
    if layer.last_indexer_loss is not None:
        assert torch.isfinite(layer.last_indexer_loss)
    cosine, similarity = _similarities(out, fp64(x)[0])
    assert cosine > 0.99 and similarity > 0.99, (cosine, similarity)


def test_mla_keys_and_values_from_the_up_projection_match_split_and_cat():
    """`LatentUpProjection.keys_values_of` (K joined by two copies, its own backward) against the plain split and
    `cat` of the expanded RoPE key: the same K and V, and `gradcheck` of both outputs in float64 (GQA groups,
    the gradient of the shared RoPE key summed over them)."""
    from megatron_dsa.layers.cores import LatentUpProjection

    up = LatentUpProjection(groups=3, qk_head_dim=5, v_head_dim=4)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(7, 3 * (5 + 4), generator=gen, dtype=torch.float64, requires_grad=True)
    rope = torch.randn(7, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = up.keys_values_of(kv, rope)
    k_nope, v_want = kv.unflatten(1, (3, -1)).split((5, 4), dim=-1)
    assert torch.equal(k, torch.cat((k_nope, rope.unsqueeze(1).expand(-1, 3, -1)), dim=-1))
    assert torch.equal(v, v_want)
    assert torch.autograd.gradcheck(lambda a, b: up.keys_values_of(a, b), (kv, rope))
