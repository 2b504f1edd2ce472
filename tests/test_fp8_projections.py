"""FP8 projections (`projection_precision="fp8"`): the per-row e4m3 rounding, the `fp8_gemm` reference, the
FP8 linear's forward and backward, the layer's error against its native products, TP-N == TP-1 up to FP8
rounding, the config and backend errors, and (GPU) `torch._scaled_mm` against the reference.

Error scale of FP8 products. e4m3 keeps 3 mantissa bits: rounding a value changes it by at most 2⁻⁴ of
itself, about 2.4% RMS for values spread over a binade. A product of two rounded operands carries both
(≈ 3.4% RMS), and a sum of K such products of random signs keeps that *relative* size (its error and its
value both grow as √K): one FP8 GEMM of random data is ≈ 3.7% off in relative Frobenius norm. A layer chains
up to four such GEMMs around its norms and attention: 6–12% measured on the tiny preset (output 6–8.5%, the
norm gains' gradients up to 11.7%; cosines ≥ 0.993). bf16 products (2⁻⁹) are ≈ 16× closer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.backends import BackendUnavailableError, call_counts, reset_call_counts
from megatron_dsa.backends import probes, torch_scaled_mm
from megatron_dsa.layers import projection_gemms
from megatron_dsa.layers.decoding import LayerCache
from megatron_dsa.layers.projection_gemms import Fp8Gemms
from megatron_dsa.layers.submodules import HybridAttentionSubmodules
from megatron_dsa.ops.fp8_linear import (FP8_MAX, RoundedWeight, RoundedWeights, fp8_gemm_reference,
                                         fp8_grouped_linear, fp8_linear, quantize_rows)
from megatron_dsa.ops.output_projection import grouped_output_projection
from megatron_dsa.ops.stacked_projection import stacked_projection
from megatron_dsa.parallel import initialize_parallel_state
from megatron_dsa.parallel.linear import ColumnParallelLinear, RowParallelLinear
from megatron_dsa.parallel.mappings import scatter_to_sequence_parallel_region
from megatron_dsa.parallel.sharding import load_full_state_dict

GEMM_RELATIVE_ERROR = 0.06  # one FP8 GEMM of random data: ≈ 3.7% measured
LAYER_RELATIVE_ERROR = 0.2  # output, input and parameter gradients of a layer: ≤ 11.7% measured
LAYER_COSINE = 0.985  # ≥ 0.993 measured
# The indexer's parameters are trained by the KL loss alone, whose gradient `p − target` is a difference of
# nearly equal probabilities: the FP8 noise of both is amplified (≤ 26% measured, cosines ≥ 0.968).
INDEXER_RELATIVE_ERROR, INDEXER_COSINE = 0.4, 0.92


# ------------------------------------------------------------------------------ independent constructions
def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """The nearest e4m3 value of float64 `v` (|v| ≤ 448; ties to even): 3 mantissa bits below the leading one,
    binades 2⁻⁶ … 2⁸, subnormals below 2⁻⁶ in steps of 2⁻⁹."""
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6)))
    step = 2.0 ** (exponent - 3)
    return torch.round(v / step) * step


def rounded_rows(t: torch.Tensor) -> torch.Tensor:
    """Each row of float64 `t` divided by amax/448, rounded to e4m3, multiplied back."""
    scale = t.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny) / 448
    return round_to_e4m3(t / scale) * scale


def hand_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return rounded_rows(a.double()) @ rounded_rows(b.double()).t()


def exact_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """An `fp8_gemm` stand-in without rounding: what the FP8 linear computes around its GEMMs."""
    return (a.double() @ b.double().t()).to(out_dtype)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm())


def cosine(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float(F.cosine_similarity(actual.double().flatten(), expected.double().flatten(), dim=0))


# ------------------------------------------------------------------------------ rounding and the reference
def test_e4m3_grid_of_the_hand_rounding():
    """The independent rounding knows e4m3: its largest value, a subnormal, a tie to even."""
    values = torch.tensor([448.0, 2.0 ** -9, 3 * 2.0 ** -9, 17.0, 19.0, 0.0, -300.0], dtype=torch.float64)
    assert round_to_e4m3(values).tolist() == [448.0, 2.0 ** -9, 3 * 2.0 ** -9, 16.0, 20.0, 0.0, -288.0]
    assert torch.equal(round_to_e4m3(values), values.to(torch.float8_e4m3fn).double())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_quantize_rows_rounds_each_row_to_e4m3_with_its_amax_scale(dtype):
    rows = torch.randn(6, 40, dtype=torch.float64) * torch.logspace(-3, 3, 6, dtype=torch.float64).unsqueeze(1)
    rows[2] = 0.0  # a zero row keeps zeros
    rows[3, 5] = -1e4  # an outlier sets its row's scale
    rows = rows.to(dtype)
    q, scale = quantize_rows(rows.t().contiguous().t())  # any strides in, row-major out
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and scale.shape == (6, 1)
    nonzero = [0, 1, 3, 4, 5]
    expected_scale = rows.double().abs().amax(1, keepdim=True) / FP8_MAX
    torch.testing.assert_close(scale.double()[nonzero], expected_scale[nonzero],
                               rtol=1e-6 if dtype != torch.float64 else 1e-15, atol=0)
    assert q.float().abs().amax(1)[nonzero].eq(FP8_MAX).all(), "every row's largest value lands on 448"
    assert torch.equal(q.double(), round_to_e4m3(rows.double() / scale.double()))
    assert not q[2].float().any()


def test_reference_gemm_is_the_product_of_the_rounded_rows():
    a, b = torch.randn(9, 48, dtype=torch.float64), torch.randn(5, 48, dtype=torch.float64) * 1e-3
    torch.testing.assert_close(fp8_gemm_reference(a, b, torch.float64), hand_gemm(a, b), rtol=1e-13, atol=1e-16)
    exact = a @ b.t()
    assert 0.01 < relative_error(fp8_gemm_reference(a, b, torch.float64), exact) < GEMM_RELATIVE_ERROR
    assert fp8_gemm_reference(a.float(), b.bfloat16(), torch.bfloat16).dtype == torch.bfloat16


# ------------------------------------------------------------------------------ the FP8 linear
def test_fp8_linear_without_rounding_is_the_linear_and_its_gradients():
    """Structure: with an exact GEMM the FP8 linear's forward and backward are `F.linear`'s (operands,
    transposes, gradient rows, groups), for the plain, stacked and grouped products."""
    x = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 4, 24, dtype=torch.float64)
    outputs = [fp8_linear(x, w, exact_gemm), F.linear(x, w)]
    grads = [torch.autograd.grad(out, (x, w), grad) for out in outputs]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-13, atol=1e-13)
    for mine, theirs in zip(*grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-13, atol=1e-13)

    rows = x.detach().view(12, 16).requires_grad_()
    weights = [torch.randn(n, 16, dtype=torch.float64, requires_grad=True) for n in (8, 5, 3)]
    stacked = fp8_linear(rows, torch.cat(weights), exact_gemm, grad_rows=8 + 5).split([8, 5, 3], dim=1)
    expected = stacked_projection(rows, weights, attached=2)
    upstream = [torch.randn_like(t) for t in expected]
    mine = torch.autograd.grad(stacked, (rows, *weights), upstream)
    theirs = torch.autograd.grad(expected, (rows, *weights), upstream)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)

    o = torch.randn(12, 4 * 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4 * 5, 6, dtype=torch.float64, requires_grad=True)
    grouped = fp8_grouped_linear(o, weight.view(4, 5, 6), exact_gemm)
    expected = grouped_output_projection(o, weight, 4)
    upstream = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad(grouped, (o, weight), upstream),
                    torch.autograd.grad(expected, (o, weight), upstream)):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_fp8_linear_rounds_every_gemm_along_its_contraction():
    """Forward `x·Wᵀ`, input gradient `dy·W` and weight gradient `dyᵀ·x`, each from operands rounded per row of
    its own contraction (hand-composed), and within the FP8 error of the exact products."""
    x = torch.randn(20, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(20, 16, dtype=torch.float64)
    out = fp8_linear(x, w, fp8_gemm_reference)
    out.backward(grad)
    checks = [(out, hand_gemm(x, w), x.detach() @ w.detach().t()),
              (x.grad, hand_gemm(grad, w.detach().t()), grad @ w.detach()),
              (w.grad, hand_gemm(grad.t(), x.detach().t()), grad.t() @ x.detach())]
    for actual, by_hand, exact in checks:
        torch.testing.assert_close(actual, by_hand, rtol=1e-12, atol=1e-14)
        assert relative_error(actual, exact) < GEMM_RELATIVE_ERROR


def test_fp8_linear_leaves_saved_tensors_and_inputs_alone():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    before = (x.detach().clone(), w.detach().clone())
    fp8_linear(x, w, fp8_gemm_reference).sum().backward()
    assert torch.equal(x.detach(), before[0]) and torch.equal(w.detach(), before[1])


def test_fp8_linear_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"fp8_linear: x \(4, 8\) and weight \(3, 9\)"):
        fp8_linear(torch.randn(4, 8), torch.randn(3, 9), fp8_gemm_reference)
    with pytest.raises(ValueError, match=r"grad_rows must be in \[0, 3\], got 4"):
        fp8_linear(torch.randn(4, 8), torch.randn(3, 8), fp8_gemm_reference, grad_rows=4)


# ------------------------------------------------------------------------------ the layer
def tiny(kind: str, **overrides) -> HybridAttentionConfig:
    return HybridAttentionConfig.from_preset("tiny", **{"num_layers": 1, "layer_pattern": kind, **overrides})


def layer_step(layer: HybridAttention, x: torch.Tensor, upstream: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out, _ = layer(x)
    out.backward(upstream)
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", "WCHM")
def test_fp8_layer_stays_within_the_fp8_error_of_the_native_layer(kind):
    torch.manual_seed(0)
    native = HybridAttention(tiny(kind), kind=kind)
    fp8 = HybridAttention(tiny(kind, projection_precision="fp8"), kind=kind)
    fp8.load_state_dict(native.state_dict())
    x, upstream = torch.randn(32, 2, 128), torch.randn(32, 2, 128)
    reset_call_counts()
    out, grad_x, grads = layer_step(fp8, x, upstream)
    gemms = call_counts()[("unfused", "fp8_gemm")]
    expected_out, expected_grad_x, expected_grads = layer_step(native, x, upstream)
    assert gemms >= 12 and not any(op == "fp8_gemm" for _, op in call_counts() if _ != "unfused")
    pairs = [("output", out, expected_out), ("input grad", grad_x, expected_grad_x)]
    pairs += [(f"grad {name}", grads[name], expected) for name, expected in expected_grads.items()
              if expected.norm() > 0]
    for what, actual, expected in pairs:
        indexer = "indexer" in what
        error, similarity = relative_error(actual, expected), cosine(actual, expected)
        assert error < (INDEXER_RELATIVE_ERROR if indexer else LAYER_RELATIVE_ERROR), f"{kind} {what}: {error:.3f}"
        assert similarity > (INDEXER_COSINE if indexer else LAYER_COSINE), f"{kind} {what}: cosine {similarity:.4f}"
    assert relative_error(out, expected_out) > 0.005, "the FP8 products left no trace: did they run?"


# The weights docs/user_guide.md ('FP8 projections') lists as FP8; nothing else (norm gains, the sink, the
# compressors' `ape`, activations) may be an FP8 GEMM's weight operand.
FP8_PROJECTIONS = {
    "W": ["linear_q_down_proj", "linear_kv_proj", "linear_q_up_proj", "linear_o_group_proj", "linear_proj"],
    "C": ["linear_q_down_proj", "linear_kv_proj", "core_attention.compressor.linear_wkv",
          "core_attention.compressor.linear_wgate", "core_attention.indexer.compressor.linear_wkv",
          "core_attention.indexer.compressor.linear_wgate", "core_attention.indexer.linear_weights_proj",
          "linear_q_up_proj", "core_attention.indexer.linear_wq_b", "linear_o_group_proj", "linear_proj"],
    "H": ["linear_q_down_proj", "linear_kv_proj", "core_attention.compressor.linear_wkv",
          "core_attention.compressor.linear_wgate", "linear_q_up_proj", "linear_o_group_proj", "linear_proj"],
    "M": ["linear_q_down_proj", "linear_kv_down_proj", "linear_q_up_proj", "linear_kv_up_proj", "linear_proj"],
}


@pytest.mark.parametrize("mode", ["training", "no_grad", "inference_cache"])
@pytest.mark.parametrize("kind", "WCHM")
def test_the_fp8_gemms_take_exactly_the_documented_projection_weights(kind, mode, monkeypatch):
    """Every weight row the forward's FP8 GEMMs multiply by is a row of a documented projection weight, and
    every row of those weights is multiplied once (stacked, grouped or alone), each GEMM's other operand being
    token rows: no parameter outside the list is rounded to FP8, and no projection is skipped or repeated.
    Through an inference cache the GEMMs take the weights' kept FP8 codes (`RoundedWeights`); otherwise,
    no-grad calls included, the weights themselves."""
    torch.manual_seed(0)
    layer = HybridAttention(tiny(kind, projection_precision="fp8"), kind=kind)
    weights = dict(layer.named_parameters())
    owner, owner_of_codes = {}, {}
    for name in FP8_PROJECTIONS[kind]:
        weight = weights[name if name == "linear_o_group_proj" else f"{name}.weight"]  # [G·Ro, H·D/G] grouped
        owner.update({row.numpy().tobytes(): name for row in weight.detach()})
        codes = quantize_rows(weight.detach())[0].view(torch.uint8)
        owner_of_codes.update({row.numpy().tobytes(): name for row in codes})
    seen, took_codes = [], []

    def recording(a, b, out_dtype, b_scales=None):
        took_codes.append(b_scales is not None)
        rows, owners = (b.detach(), owner) if b_scales is None else (b.view(torch.uint8), owner_of_codes)
        rows = rows.reshape(-1, rows.shape[-1])  # kept codes of a grouped weight come as [G, N, K], in one call
        seen.extend(owners.get(row.numpy().tobytes(), "unknown") for row in rows)
        assert a.shape[0] == 2 * 16, "the other operand is the token rows"
        return fp8_gemm_reference(a, b, out_dtype, b_scales)

    monkeypatch.setattr(Fp8Gemms, "gemm", lambda self, x: recording)
    x = torch.randn(16, 2, 128)
    with torch.set_grad_enabled(mode == "training"):
        layer(x, inference_cache=LayerCache.for_layer(layer, 2, 16) if mode == "inference_cache" else None)
    assert all(took_codes) if mode == "inference_cache" else not any(took_codes)
    counts = {name: seen.count(name) for name in set(seen)}
    expected = {name: sum(1 for n in owner.values() if n == name) for name in FP8_PROJECTIONS[kind]}
    assert counts == expected


def test_default_is_native_and_never_calls_the_fp8_family():
    config = tiny("C")
    assert config.projection_precision == "native"
    x, upstream = torch.randn(16, 2, 128), torch.randn(16, 2, 128)
    steps = []
    for precision in (None, "native"):
        torch.manual_seed(0)
        layer = HybridAttention(config if precision is None else config.replace(projection_precision=precision),
                                kind="C")
        assert layer.linear_q_up_proj.matmul is F.linear and layer.linear_proj.matmul is F.linear
        reset_call_counts()
        steps.append(layer_step(layer, x, upstream))
        assert not any(op == "fp8_gemm" for _, op in call_counts())
    (out, grad_x, grads), (again, grad_x_again, grads_again) = steps
    assert torch.equal(out, again) and torch.equal(grad_x, grad_x_again)
    assert all(torch.equal(grads[name], grads_again[name]) for name in grads)


def test_fp8_runs_under_autocast_with_float32_weights():
    """The main job's mixed precision (float32 master weights, bf16 autocast): the FP8 products return the
    autocast dtype, as `F.linear` does, and the weight gradients come in float32."""
    torch.manual_seed(0)
    layer = HybridAttention(tiny("W", projection_precision="fp8"), kind="W")
    x = torch.randn(16, 2, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.gemms.linear(x, layer.linear_q_down_proj.weight).dtype == torch.bfloat16
        out, _ = layer(x)
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.linear_q_down_proj.weight.grad.dtype == torch.float32
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


@pytest.mark.parametrize("kind", "WC")
def test_fp8_decode_step_equals_the_forward_up_to_summation_order(kind):
    """Per-row scales: a token's products do not depend on the other tokens in the GEMM, so decoding token by
    token gives what the whole forward gives (a per-tensor scale would not); the decode step's stacked input
    projection multiplies by the kept FP8 codes of its cache's kept stack."""
    torch.manual_seed(0)
    layer = HybridAttention(tiny(kind, projection_precision="fp8"), kind=kind).eval()
    x = torch.randn(6, 2, 128)
    with torch.no_grad():
        full, _ = layer(x)
        cache = LayerCache.for_layer(layer, batch=2, capacity=8)
        prefix, _ = layer(x[:5], inference_cache=cache)
        last, _ = layer(x[5:], inference_cache=cache)
    torch.testing.assert_close(torch.cat((prefix, last)), full, rtol=1e-4, atol=1e-5)


def test_the_reference_gemm_takes_a_weight_already_rounded():
    a, b = torch.randn(6, 40, dtype=torch.float64), torch.randn(24, 40, dtype=torch.float64)
    rounded = RoundedWeight.of(b)
    assert rounded.codes.shape == (1, 24, 40) and rounded.scales.shape == (1, 24, 1)
    kept = fp8_gemm_reference(a, rounded.codes[0], torch.float64, rounded.scales[0])
    assert torch.equal(kept, fp8_gemm_reference(a, b, torch.float64))
    grouped = RoundedWeight.of(b).in_groups(3)
    assert torch.equal(grouped.codes[1], quantize_rows(b[8:16])[0]) and grouped.scales.shape == (3, 8, 1)
    with pytest.raises(ValueError, match=r"rounded weight codes \(1, 24, 40\).*weight \(12, 40\)"):
        fp8_linear(a, b[:12], fp8_gemm_reference, rounded=rounded)


def counting_roundings(monkeypatch) -> list:
    """The shapes of the weights `RoundedWeight.of` rounds from now on, in order."""
    calls = []
    original = RoundedWeight.of.__func__

    def counted(cls, weight):
        calls.append(tuple(weight.shape))
        return original(cls, weight)

    monkeypatch.setattr(RoundedWeight, "of", classmethod(counted))
    return calls


def through_one_cache(layer: HybridAttention, x: torch.Tensor, prompt: int = 12) -> torch.Tensor:
    """`x [S, B, d]`: a prefill of `prompt` tokens, then one decode step per token, through one new inference cache."""
    cache = LayerCache.for_layer(layer, x.shape[1], x.shape[0] + 1)
    with torch.no_grad():
        outputs = [layer(x[:prompt], inference_cache=cache)[0]]
        outputs += [layer(x[t:t + 1], inference_cache=cache)[0] for t in range(prompt, x.shape[0])]
    return torch.cat(outputs)


def prefill(layer: HybridAttention, x: torch.Tensor) -> torch.Tensor:
    """`x [S, B, d]` through a new inference cache (no gradient)."""
    with torch.no_grad():
        return layer(x, inference_cache=LayerCache.for_layer(layer, x.shape[1], x.shape[0] + 1))[0]


def rounding_every_time(monkeypatch) -> None:
    """From now on every FP8 product rounds its weight, inference caches included."""
    monkeypatch.setattr(projection_gemms, "_kept_rounding", lambda weight: None)


@pytest.mark.parametrize("kind", "WCHM")
def test_calls_through_an_inference_cache_round_each_weight_once(kind, monkeypatch):
    """Through an inference cache each projection weight is rounded once and its codes kept in the cache: the
    decode steps round nothing and the calls equal, bit for bit, the same calls rounding every weight in every
    GEMM. A no-grad call without a cache keeps nothing, nor does a product that needs a gradient; the codes go
    with the cache."""
    import gc
    import weakref

    torch.manual_seed(0)
    layer = HybridAttention(tiny(kind, projection_precision="fp8"), kind=kind)
    x = torch.randn(16, 2, 128)
    roundings = counting_roundings(monkeypatch)
    with torch.no_grad():
        layer(x)
    assert roundings == [], "a no-grad call without a cache keeps no codes"
    cache = LayerCache.for_layer(layer, 2, 17)
    with torch.no_grad():
        outputs = [layer(x[:12], inference_cache=cache)[0]]
        rounded_by_prefill = len(roundings)
        outputs += [layer(x[t:t + 1], inference_cache=cache)[0] for t in range(12, 16)]  # decode steps
    assert rounded_by_prefill >= 3 and len(roundings) == rounded_by_prefill, "the decode steps rounded again"
    assert len(cache.rounded_weights) == rounded_by_prefill
    with projection_gemms.rounded_weights_kept(cache.rounded_weights):
        layer(x)[0].sum().backward()  # products that need their weight's gradient
    assert len(roundings) == rounded_by_prefill, "a product that needs a gradient took kept codes"
    codes = weakref.ref(cache.rounded_weights)
    del cache
    gc.collect()
    assert codes() is None, "the codes outlived their cache"
    monkeypatch.undo()
    rounding_every_time(monkeypatch)
    assert torch.equal(torch.cat(outputs), through_one_cache(layer, x))


def test_a_layer_copies_and_saves_after_cached_calls():
    """`copy.deepcopy` and `torch.save` of a whole layer after calls through a cache: the codes live in the cache,
    not in the layer, and the copy and the loaded layer compute what the layer computes."""
    import copy
    import io

    torch.manual_seed(0)
    layer = HybridAttention(tiny("C", projection_precision="fp8"), kind="C")
    x = torch.randn(16, 2, 128)
    expected = prefill(layer, x)
    assert not any(isinstance(value, RoundedWeights) for module in layer.modules() for value in vars(module).values())
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert torch.equal(prefill(other, x), expected)


def test_kept_codes_follow_weights_changed_in_place_or_replaced(monkeypatch):
    """An optimizer step (in place) or `load_state_dict` changes a weight, or a new parameter replaces it: the
    cache's next call rounds it again. A decode step after such changes equals the same step through a cache that
    rounds every weight in every call."""
    store = RoundedWeights()
    weight = torch.nn.Parameter(torch.randn(24, 40))
    first = store.of(weight)
    assert store.of(weight) is first
    with torch.no_grad():
        weight.mul_(1.5)
    assert torch.equal(store.of(weight).scales, RoundedWeight.of(weight).scales) and len(store) == 1
    replacement = torch.nn.Parameter(weight.detach().clone() * 2)
    assert torch.equal(store.of(replacement).scales, RoundedWeight.of(replacement).scales) and len(store) == 2

    torch.manual_seed(0)
    layer = HybridAttention(tiny("C", projection_precision="fp8"), kind="C")
    x = torch.randn(13, 2, 128)
    kept, every_time = LayerCache.for_layer(layer, 2, 14), LayerCache.for_layer(layer, 2, 14)
    with torch.no_grad():
        layer(x[:12], inference_cache=kept)
        with monkeypatch.context() as patch:
            rounding_every_time(patch)
            layer(x[:12], inference_cache=every_time)
        layer.linear_q_up_proj.weight.mul_(1.5)
        layer.load_state_dict({"linear_o_group_proj": torch.randn_like(layer.linear_o_group_proj)}, strict=False)
        step = layer(x[12:], inference_cache=kept)[0]
        rounding_every_time(monkeypatch)
        assert torch.equal(step, layer(x[12:], inference_cache=every_time)[0])


# ------------------------------------------------------------------------------ config and backend errors
@pytest.mark.parametrize("value, message", [
    ("bf16", r"projection_precision must be one of \['native', 'fp8'\].*got 'bf16'"),
    ("FP8", r"projection_precision must be one of .*got 'FP8'"),
    (8, r"projection_precision must be a string, got 8"),
])
def test_projection_precision_is_validated(value, message):
    with pytest.raises(ValueError, match=message):
        HybridAttentionConfig(projection_precision=value)


def test_an_explicit_fp8_backend_that_cannot_run_names_what_is_missing(monkeypatch):
    overrides = {"fp8_gemm": "torch_scaled_mm"}
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="torch_scaled_mm.*fp8_gemm.*FP8 GEMMs need a CUDA GPU"):
            HybridAttention(tiny("W", projection_precision="fp8", attention_backend_overrides=overrides), kind="W")
    monkeypatch.setattr(probes, "cuda_capability", lambda device: (8, 0))
    assert "compute capability >= 8.9" in torch_scaled_mm.probe(None, {"device": torch.device("cuda")})
    assert "this GPU is 8.0" in torch_scaled_mm.probe(None, {"device": torch.device("cuda")})
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    assert "needs torch >= 2.5" in torch_scaled_mm.probe(None, {"device": torch.device("cuda")})


def test_auto_runs_the_reference_where_fp8_tensor_cores_are_missing():
    gemms = Fp8Gemms(tiny("W"))
    reset_call_counts()
    gemms.linear(torch.randn(4, 16), torch.randn(8, 16))
    assert call_counts() == {("unfused", "fp8_gemm"): 1}


def test_fp8_with_a_host_linear_class_is_refused():
    submodules = HybridAttentionSubmodules(column_parallel_linear=lambda i, o, group, std: torch.nn.Linear(i, o))
    with pytest.raises(ValueError, match="projection_precision='fp8'.*column_parallel_linear"):
        HybridAttention(tiny("W", projection_precision="fp8"), kind="W", submodules=submodules)


def test_the_main_job_takes_the_field_from_its_attention_section():
    """`python -m megatron_dsa.train --config job.yaml` with `attention: {projection_precision: fp8}` builds
    every layer of its model with FP8 products."""
    from megatron_dsa.job.config import JobConfig
    from megatron_dsa.job.steps import build_model

    attention = HybridAttentionConfig.from_preset("tiny").to_dict()  # four layers, WCHC
    job = JobConfig.from_dict({"attention": {**attention, "projection_precision": "fp8"}})
    model = build_model(job, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, HybridAttention)]
    assert len(layers) == 4 and all(isinstance(layer.gemms, Fp8Gemms) for layer in layers)
    with pytest.raises(ValueError, match="projection_precision must be one of"):
        JobConfig.from_dict({"attention": {"projection_precision": "e4m3"}})


# ------------------------------------------------------------------------------ tensor parallelism
def tp_fp8_body(rank: int, world: int) -> None:
    """Column-parallel: the forward and the weight gradient round along unsplit contractions, so each rank's
    slice equals TP = 1's; the input gradient sums per-rank FP8 products whose scales cover each rank's
    slice. Row-parallel: the reverse. A C layer with sequence parallelism: within the FP8 error of TP = 1."""
    state = initialize_parallel_state(tp_size=world)
    gemm = Fp8Gemms(tiny("C")).linear
    torch.manual_seed(3)
    x = torch.randn(24, 32, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(24, 48, dtype=torch.float64)
    for cls, dim in ((ColumnParallelLinear, 0), (RowParallelLinear, 1)):
        full = cls(32, 48, None, 0.02, matmul=gemm).double()
        local = cls(32, 48, state.tp_group, 0.02, matmul=gemm).double()
        with torch.no_grad():
            local.weight.copy_(full.weight.chunk(world, dim)[rank])
        x_local = x.detach().chunk(world, 1)[rank] if dim == 1 else x.detach()
        x_local.requires_grad_()
        mine = lambda t: t.chunk(world, 1)[rank] if dim == 0 else t  # noqa: E731
        x.grad = None
        full(x).backward(upstream)
        local(x_local).backward(mine(upstream))
        own = full.weight.grad.chunk(world, dim)[rank]
        exact_forward = mine(full(x).detach())
        close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # noqa: E731
        grad_x = x.grad.chunk(world, 1)[rank] if dim == 1 else x.grad
        if cls is ColumnParallelLinear:
            close(local(x_local).detach(), exact_forward)
            close(local.weight.grad, own)
            assert relative_error(x_local.grad, grad_x) < GEMM_RELATIVE_ERROR
        else:
            close(x_local.grad, grad_x)
            close(local.weight.grad, own)
            assert relative_error(local(x_local).detach(), exact_forward) < GEMM_RELATIVE_ERROR

    config = tiny("C", projection_precision="fp8", sequence_parallel=True, o_groups=4, dsa_indexer_topk=64)
    torch.manual_seed(5)
    ref = HybridAttention(config.replace(sequence_parallel=False), kind="C").double()
    layer = HybridAttention(config, kind="C", parallel_state=state).double()
    load_full_state_dict(layer, ref.state_dict(), state)
    x = torch.randn(32, 2, 128, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(32, 2, 128, dtype=torch.float64)
    out_ref, _ = ref(x)
    (out_ref * upstream).sum().backward()
    x_local = x.detach().clone().requires_grad_()
    out, _ = layer(scatter_to_sequence_parallel_region(x_local, state.tp_group))
    (out * upstream.chunk(world)[rank]).sum().backward()
    assert relative_error(out, out_ref.detach().chunk(world)[rank]) < LAYER_RELATIVE_ERROR
    assert relative_error(x_local.grad, x.grad) < LAYER_RELATIVE_ERROR


def test_fp8_tensor_parallel_matches_tp1_up_to_fp8_rounding():
    run_distributed(tp_fp8_body, 2)


def test_scaled_mm_backend_takes_kept_codes_where_torch_runs_it_on_the_cpu():
    """The backend's function itself (its probe declines the CPU, `auto` never picks it there) where this torch
    has a CPU `_scaled_mm`: kept codes give the product of rounding the weight in the call, padded shapes too."""
    a, b = torch.randn(5, 72, dtype=torch.bfloat16), torch.randn(40, 72, dtype=torch.bfloat16)
    try:
        fused = torch_scaled_mm.fp8_gemm(a, b, torch.float32)
    except (RuntimeError, NotImplementedError) as error:
        pytest.skip(f"this torch has no CPU _scaled_mm: {error}")
    rounded = RoundedWeight.of(b)
    assert torch.equal(torch_scaled_mm.fp8_gemm(a, rounded.codes[0], torch.float32, rounded.scales[0]), fused)
    assert relative_error(fused, fp8_gemm_reference(a, b, torch.float32)) < 4e-3


# ------------------------------------------------------------------------------ GPU: torch._scaled_mm
def fp8_gpu_or_skip() -> torch.device:
    device = torch.device("cuda")
    reason = torch_scaled_mm.probe(None, {"device": device})
    if reason is not None:
        pytest.skip(reason)
    return device


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 512, 384), (100, 72, 40),  # aligned; unaligned K and N (zero-padded)
                                   (32, 1024, 4096), (1, 72, 40)])  # a decode step's few rows
def test_scaled_mm_matches_the_reference(shape):
    """Same rounding on both sides: only the order of the fp32 accumulation and the bf16 output differ."""
    device = fp8_gpu_or_skip()
    m, k, n = shape
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    fused, reference = torch_scaled_mm.fp8_gemm(a, b, torch.float32), fp8_gemm_reference(a, b, torch.float32)
    assert fused.shape == (m, n) and fused.is_contiguous()
    assert relative_error(fused, reference) < 4e-3  # bf16 output rounding (2⁻⁹) dominates
    rounded = RoundedWeight.of(b)  # kept codes (inference): the same codes and scales, so the same product
    assert torch.equal(torch_scaled_mm.fp8_gemm(a, rounded.codes[0], torch.float32, rounded.scales[0]), fused)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", "WCHM")
def test_fp8_layer_on_scaled_mm_matches_its_emulation(kind):
    """The whole bf16 layer on `torch_scaled_mm` against the same layer on the `unfused` reference GEMMs, forward
    and every gradient; the counters prove which GEMMs ran."""
    device = fp8_gpu_or_skip()
    torch.manual_seed(0)
    config = tiny(kind, projection_precision="fp8", dsa_indexer_topk=128)  # every entry kept: no selection flips
    fused = HybridAttention(config, kind=kind).to(device).bfloat16()
    emulated = HybridAttention(config.replace(attention_backend_overrides={"fp8_gemm": "unfused"}),
                               kind=kind).to(device).bfloat16()
    emulated.load_state_dict(fused.state_dict())
    x = torch.randn(256, 2, 128, device=device, dtype=torch.bfloat16)
    upstream = torch.randn_like(x)
    reset_call_counts()
    out, grad_x, grads = layer_step(fused, x, upstream)
    counts = call_counts()
    assert counts.get(("torch_scaled_mm", "fp8_gemm"), 0) >= 12 and ("unfused", "fp8_gemm") not in counts
    reset_call_counts()
    expected_out, expected_grad_x, expected_grads = layer_step(emulated, x, upstream)
    assert ("torch_scaled_mm", "fp8_gemm") not in call_counts()
    pairs = [("output", out, expected_out), ("input grad", grad_x, expected_grad_x)]
    pairs += [(name, grads[name], g) for name, g in expected_grads.items() if g.norm() > 0]
    # Not equal up to accumulation order: the paths round differently to bf16 (scaled_mm writes bf16, the
    # emulation float32 then casts), and every later quantization turns some of those half-ulp differences
    # into whole e4m3 steps (2⁻⁴ relative). Measured on an H200: weight gradients 0.031-0.033 apart. The bound is
    # one e4m3 step (the indexer's, whose scores feed a softmax over few keys, four).
    failures = [f"{what}: cosine {cosine(actual, expected):.4f}, relative error {relative_error(actual, expected):.4f}"
                for what, actual, expected in pairs
                if cosine(actual, expected) <= (0.99 if "indexer" in what else 0.998)
                or relative_error(actual, expected) >= (0.25 if "indexer" in what else 0.0625)]
    assert not failures, f"{kind}:\n" + "\n".join(failures)
