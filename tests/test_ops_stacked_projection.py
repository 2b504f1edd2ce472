"""The stacked projection (one GEMM for the projections of the layer input) against separate linears, and
the layer's use of it: stacked == separate module calls, hooks and other modules keep the separate path."""

import pytest
import torch
from torch import nn

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.layers.common import project_rows
from megatron_dsa.ops import stacked_projection as stacked_module
from megatron_dsa.layers.projection_gemms import NATIVE
from megatron_dsa.ops.stacked_projection import KeptStack, stacked_projection, stacked_weights

F64 = torch.float64
SIZES = (6, 3, 5, 2)


def _leaves(seed=0, rows=7, width=4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen, dtype=F64, requires_grad=True)
    weights = [torch.randn(n, width, generator=gen, dtype=F64, requires_grad=True) for n in SIZES]
    return x, weights


def _grads(outputs, upstream, leaves):
    used = [(out * up).sum() for out, up in zip(outputs, upstream) if up is not None]
    return torch.autograd.grad(sum(used), leaves, allow_unused=True)


def test_a_kept_stack_is_stacked_again_only_when_a_weight_changes():
    """An inference cache's kept stack: the same tensor while the weights are unchanged; an in-place update
    (an optimizer step, `load_state_dict`) or another weight tensor stacks them again, so products never read
    stale weights. Only products that need no gradient use it."""
    _, weights = _leaves()
    kept = KeptStack()
    with torch.no_grad():
        first = kept.of(weights)
        assert torch.equal(first, torch.cat(weights)) and kept.of(weights) is first
        weights[1].mul_(2.0)
        second = kept.of(weights)
        assert second is not first and torch.equal(second, torch.cat(weights))
        swapped = [weights[0].clone(), *weights[1:]]
        assert kept.of(swapped) is not second and torch.equal(kept.of(swapped), torch.cat(swapped))
    assert stacked_weights(weights, kept) is None  # grad mode on and weights requiring grad: autograd stacks
    with torch.no_grad():
        x = torch.randn(3, weights[0].shape[1], dtype=F64)
        for got, weight in zip(NATIVE.stacked(x, weights, 2, kept), weights):
            # Not bit for bit: a BLAS may pick another kernel (FMA or not) for the stacked width than for one weight's.
            torch.testing.assert_close(got, x @ weight.t(), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("attached,used", [(0, "all"), (2, "all"), (4, "all"), (0, "first and last"),
                                           (2, "first and last"), (4, "first and last"), (2, "detached only")])
def test_matches_separate_projections(attached, used):
    """Values, x's gradient (attached outputs only) and each weight's gradient (None when its output is
    unused) equal separate `x @ W^T` with the detached ones reading `x.detach()`; float64, so the only
    difference is the summation order inside the GEMMs (1e-12)."""
    x, weights = _leaves()
    gen = torch.Generator().manual_seed(1)
    upstream = [torch.randn(x.shape[0], n, generator=gen, dtype=F64) for n in SIZES]
    if used == "first and last":
        upstream[1:-1] = [None] * (len(SIZES) - 2)
    elif used == "detached only":
        upstream[:attached] = [None] * attached
    got = stacked_projection(x, weights, attached)
    expected = [(x if i < attached else x.detach()) @ w.T for i, w in enumerate(weights)]
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.stride(1) == 1
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    got_grads = _grads(got, upstream, [x, *weights])
    expected_grads = _grads(expected, upstream, [x, *weights])
    for name, a, b in zip(["x"] + [f"w{i}" for i in range(len(SIZES))], got_grads, expected_grads):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_weights_without_grad_and_no_grad_mode():
    x, weights = _leaves()
    frozen = [w.detach() for w in weights]
    out = stacked_projection(x, frozen, 2)
    (grad_x,) = torch.autograd.grad(sum(o.sum() for o in out), [x])
    torch.testing.assert_close(grad_x, sum(w[:].sum(0) for w in frozen[:2]).expand_as(x))
    with torch.no_grad():
        out = stacked_projection(x, weights, 2)
    assert not any(o.requires_grad for o in out)


@pytest.mark.parametrize("case,error,match", [
    ("x 3d", ValueError, r"x \[T, d\]"),
    ("width", ValueError, "weight 1 must be"),
    ("dtype", TypeError, "weight 0 is torch.float32"),
    ("device", ValueError, "weight 0 is on meta"),
    ("attached", ValueError, "attached must be in"),
])
def test_bad_inputs_are_refused(case, error, match):
    x, weights = _leaves()
    attached = 1
    if case == "x 3d":
        x = x.unsqueeze(0)
    elif case == "width":
        weights[1] = weights[1][:, :3]
    elif case == "dtype":
        weights[0] = weights[0].float()
    elif case == "device":
        weights[0] = weights[0].to("meta")
    else:
        attached = 5
    with pytest.raises(error, match=match):
        stacked_projection(x, weights, attached)


def _linears(seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(4, n, bias=False).double() for n in SIZES]


def _count_stacked(monkeypatch):
    calls = []
    original = stacked_module.StackedProjection.apply
    monkeypatch.setattr(stacked_module.StackedProjection, "apply",
                        lambda *args: calls.append(1) or original(*args))
    return calls


@pytest.mark.parametrize("variant", ["plain", "hook", "bias", "subclass", "one linear"])
def test_project_rows_stacks_only_plain_linears(monkeypatch, variant):
    """Plain bias-free `nn.Linear`s in x's dtype are stacked; a linear with a hook (which must run), a bias
    or another class makes every module be called; the outputs are the same either way."""
    x, _ = _leaves()
    linears = _linears()
    hooked = []
    if variant == "hook":
        linears[1].register_forward_hook(lambda module, args, out: hooked.append(out.shape))
    elif variant == "bias":
        linears[2] = nn.Linear(4, SIZES[2]).double()
    elif variant == "subclass":
        linears[0] = type("MyLinear", (nn.Linear,), {})(4, SIZES[0], bias=False).double()
    elif variant == "one linear":
        linears = linears[:1]
    calls = _count_stacked(monkeypatch)
    projected = project_rows(x, linears[:2], linears[2:])
    assert len(calls) == (1 if variant == "plain" else 0)
    assert hooked == ([(7, SIZES[1])] if variant == "hook" else [])
    for i, linear in enumerate(linears):
        source = x if i < 2 else x.detach()
        expected = linear(source)
        torch.testing.assert_close(projected[linear], expected, rtol=1e-12, atol=1e-12)
        assert projected[linear].requires_grad == (x.requires_grad if i < 2 else linear.weight.requires_grad)


def _small_config(**overrides):
    return HybridAttentionConfig.from_preset("tiny", attention_backend="unfused", **overrides)


def _step(layer, x, upstream):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x)[0]
    (out * upstream).sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


@pytest.mark.parametrize("kind", list("WCHM"))
def test_layer_stacked_equals_separate_module_calls(monkeypatch, kind):
    """Metamorphic: the layer with its input projections stacked and the same layer with every linear called
    (a no-op hook on one forces that) give the same output, input gradient and parameter gradients (None
    where the separate path gives None), float64."""
    layer = HybridAttention(_small_config(), kind=kind).double().train()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 2, 128, generator=gen, dtype=F64, requires_grad=True)
    upstream = torch.randn(40, 2, 128, generator=gen, dtype=F64)
    calls = _count_stacked(monkeypatch)
    stacked = _step(layer, x, upstream)
    assert len(calls) == 1
    handle = layer.linear_q_down_proj.register_forward_hook(lambda *args: None)
    separate = _step(layer, x, upstream)
    handle.remove()
    assert len(calls) == 1
    torch.testing.assert_close(stacked[0], separate[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stacked[1], separate[1], rtol=1e-10, atol=1e-12)
    for name, grad in separate[2].items():
        got = stacked[2][name]
        assert (got is None) == (grad is None), name
        if grad is not None:
            torch.testing.assert_close(got, grad, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_indexer_weights_get_no_grad_without_the_indexer_loss():
    """In eval mode the C layer attaches no indexer loss: the indexer's stacked projections get no gradient
    (None, as with separate linears), the rest does."""
    layer = HybridAttention(_small_config(), kind="C").double().eval()
    x = torch.randn(40, 1, 128, dtype=F64, requires_grad=True)
    layer(x)[0].sum().backward()
    indexer = layer.core_attention.indexer
    for linear in indexer.projections():
        assert linear.weight.grad is None
    assert layer.core_attention.compressor.linear_wkv.weight.grad is not None
    assert layer.linear_q_down_proj.weight.grad is not None


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list("WCH"))
def test_layer_stacked_equals_separate_on_gpu_bf16(monkeypatch, kind):
    """bf16 on a GPU, dsv4-flash dims at S = 1024 (auto backends): stacked == separate module calls for the
    output, the input gradient and every parameter gradient. Both make the same products over the same K;
    only cuBLAS's tiling of a wider N may round a bf16 output differently (1 ulp, 2^-8 relative), which
    the rest of the layer carries: cosine ≥ 0.9999, relative error (‖a − b‖ / ‖b‖) ≤ 1e-2."""
    config = HybridAttentionConfig.from_preset("dsv4-flash")
    layer = HybridAttention(config, kind=kind).cuda().bfloat16().train()
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1024, 1, config.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    upstream = torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    calls = _count_stacked(monkeypatch)
    stacked = _step(layer, x, upstream)
    handle = layer.linear_q_down_proj.register_forward_hook(lambda *args: None)
    separate = _step(layer, x, upstream)
    handle.remove()
    assert len(calls) == 1
    pairs = [("out", stacked[0], separate[0]), ("dx", stacked[1], separate[1])]
    pairs += [(name, stacked[2][name], grad) for name, grad in separate[2].items()]
    for name, a, b in pairs:
        assert (a is None) == (b is None), name
        if b is None:
            continue
        assert _cosine(a, b) >= 0.9999, (name, _cosine(a, b))
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= 1e-2, name
