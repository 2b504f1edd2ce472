"""A NaN or infinity in one token reaches only the rows that can see it (issue #25).

For every kind (W / C / H / M) a non-finite value injected into the layer input at a later token, in
another batch row, or in another packed document leaves every row outside its reach bit-identical to
the clean run (finite), and the input gradients of the other batch rows / documents bit-identical
too. The dense `M` kind used to leak it: its chunks (and fused kernels' tiles) multiply masked
probabilities, 0, with every key row of their window, and 0·NaN = NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from megatron_dsa.backends import call_counts, reset_call_counts
from megatron_dsa.backends.dense_layout import isolate_non_finite
from megatron_dsa.ops.dense_attention import attention_block, causal_attention
from megatron_dsa.ops.layout import TokenLayout
from test_packed_support import make_layer, pack, random_segments

F64 = torch.float64
BAD_VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@dataclass
class Run:
    out: Tensor
    grad: Tensor


def _run(layer, hidden: Tensor, grad_out: Tensor, packed=None) -> Run:
    hidden = hidden.detach().clone().requires_grad_(True)
    out, _ = layer(hidden, packed_seq_params=packed)
    out.backward(grad_out)
    return Run(out.detach(), hidden.grad)


def _assert_same(got: Tensor, expected: Tensor, what: str) -> None:
    assert torch.isfinite(got).all(), f"{what}: non-finite values leaked in"
    assert torch.equal(got, expected), f"{what}: differs from the clean run"


@pytest.mark.parametrize("value", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("kind", "WCHM")
def test_bad_token_reaches_neither_earlier_tokens_nor_other_batch_rows(kind, value):
    """One bad element at token 20 of batch row 0 (S = 24, B = 2): tokens 0–19 of row 0 and all of row
    1 are unchanged; row 1's input gradient too; token 20 itself is non-finite."""
    layer = make_layer(kind)
    hidden = torch.randn(24, 2, layer.config.hidden_size, dtype=F64)
    grad_out = torch.randn_like(hidden)
    clean = _run(layer, hidden, grad_out)
    bad_hidden = hidden.clone()
    bad_hidden[20, 0, 3] = BAD_VALUES[value]
    bad = _run(layer, bad_hidden, grad_out)
    _assert_same(bad.out[:20, 0], clean.out[:20, 0], "earlier tokens of the row")
    _assert_same(bad.out[:, 1], clean.out[:, 1], "the other batch row")
    _assert_same(bad.grad[:, 1], clean.grad[:, 1], "input gradient of the other batch row")
    assert not torch.isfinite(bad.out[20, 0]).all(), "the bad token's own output should show it"


@pytest.mark.parametrize("value", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("kind", "WCHM")
def test_bad_token_stays_in_its_packed_document(kind, value):
    """Documents of 9, 11 and 8 tokens packed with a padding row each; a bad element at token 4 of the
    middle document: the first and last documents (output and input gradient) and tokens 0–3 of the
    middle one are unchanged."""
    layer = make_layer(kind)
    segments = random_segments([9, 11, 8], layer.config.hidden_size)
    clean_pack = pack(segments, pads=[1, 1, 1], tail=2)
    grad_out = clean_pack.like(random_segments([9, 11, 8], layer.config.hidden_size), fill=0.0).unsqueeze(1)
    clean = _run(layer, clean_pack.hidden, grad_out, clean_pack.params)
    segments[1] = segments[1].clone()
    segments[1][4, 0] = BAD_VALUES[value]
    bad_pack = pack(segments, pads=[1, 1, 1], tail=2)
    bad = _run(layer, bad_pack.hidden, grad_out, bad_pack.params)
    first, middle, last = clean_pack.real
    for name, rows in (("first document", first), ("last document", last)):
        _assert_same(bad.out[rows], clean.out[rows], name)
        _assert_same(bad.grad[rows], clean.grad[rows], f"input gradient of the {name}")
    earlier = slice(middle.start, middle.start + 4)
    _assert_same(bad.out[earlier], clean.out[earlier], "earlier tokens of the middle document")
    assert not torch.isfinite(bad.out[middle.start + 4]).all()


@pytest.mark.parametrize("position", [0, 5, 11], ids=["first", "middle", "last"])
def test_mla_torch_sdpa_isolates_like_the_reference(position):
    """Kind M on torch's fused CPU kernel (requested by name): a NaN at `position` of row 0 of S = 12
    leaves the earlier tokens and row 1 unchanged. The kernel alone leaks it into its tile."""
    layer = make_layer("M", attention_backend_overrides={"dense_attention": "torch_sdpa"})
    hidden = torch.randn(12, 2, layer.config.hidden_size, dtype=F64)
    grad_out = torch.randn_like(hidden)
    reset_call_counts()
    clean = _run(layer, hidden, grad_out)
    assert call_counts().get(("torch_sdpa", "dense_attention")) == 1
    bad_hidden = hidden.clone()
    bad_hidden[position, 0] = float("nan")
    bad = _run(layer, bad_hidden, grad_out)
    _assert_same(bad.out[:position, 0], clean.out[:position, 0], "earlier tokens")
    _assert_same(bad.out[:, 1], clean.out[:, 1], "the other batch row")
    _assert_same(bad.grad[:, 1], clean.grad[:, 1], "input gradient of the other batch row")


# ------------------------------------------------------------------ the op and its backward
def _qkv(rows: int, heads: int = 4, groups: int = 2, dim: int = 8):
    return (torch.randn(rows, heads, dim, dtype=F64), torch.randn(rows, groups, dim, dtype=F64),
            torch.randn(rows, groups, dim, dtype=F64))


def _op_grads(q, k, v, layout, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = causal_attention(*leaves, layout, 0.3)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_causal_attention_op_isolates_each_input(tensor):
    """Two segments of 6 and 5 rows: a NaN in one element of `tensor` at row 8 (segment 2) changes no
    output or gradient of segment 1, nor the outputs of rows 6–7; rows 8–10 read NaN."""
    layout = TokenLayout.packed(torch.tensor([0, 6, 11], dtype=torch.int32), 11, torch.device("cpu"))
    q, k, v = _qkv(11)
    grad_out = torch.randn(11, 4, 8, dtype=F64)
    clean_out, clean_grads = _op_grads(q, k, v, layout, grad_out)
    poisoned = dict(q=q.clone(), k=k.clone(), v=v.clone())
    poisoned[tensor][8, 1, 2] = float("nan")
    out, grads = _op_grads(poisoned["q"], poisoned["k"], poisoned["v"], layout, grad_out)
    _assert_same(out[:8], clean_out[:8], "rows before the NaN")
    for name, got, expected in zip("qkv", grads, clean_grads):
        _assert_same(got[:6], expected[:6], f"d{name} of the other segment")
    assert torch.isnan(out[8:]).any(dim=(1, 2)).all() if tensor != "q" else torch.isnan(out[8]).any()


def test_nan_output_gradient_reaches_only_visible_keys():
    """A NaN output gradient at row 2 of segment 1: dK/dV of rows 0–2 are NaN (row 2 sees them), every
    gradient of segment 2 and dK/dV of rows 3–5 are unchanged (0·NaN would have spread it)."""
    layout = TokenLayout.packed(torch.tensor([0, 6, 11], dtype=torch.int32), 11, torch.device("cpu"))
    q, k, v = _qkv(11)
    grad_out = torch.randn(11, 4, 8, dtype=F64)
    _, clean_grads = _op_grads(q, k, v, layout, grad_out)
    grad_out[2, 0, 0] = float("nan")
    _, grads = _op_grads(q, k, v, layout, grad_out)
    for name, got, expected in zip("qkv", grads, clean_grads):
        _assert_same(got[6:], expected[6:], f"d{name} of the other segment")
    for name, got, expected in zip("kv", grads[1:], clean_grads[1:]):
        _assert_same(got[3:6], expected[3:6], f"d{name} of keys row 2 cannot see")
        assert torch.isnan(got[:3]).any(dim=(1, 2)).all(), f"d{name} of the keys row 2 sees"


def test_past_block_poisons_only_its_own_rows():
    """A context-parallel past block (every key visible): a NaN query row is NaN, the others are exact."""
    q, k, v = _qkv(5)
    clean_out, clean_lse = attention_block(q, k[:4], v[:4], 0.3, causal=False)
    q[1, 0, 0] = float("nan")
    out, lse = attention_block(q, k[:4], v[:4], 0.3, causal=False)
    rows = [0, 2, 3, 4]
    _assert_same(out[rows], clean_out[rows], "other query rows")
    _assert_same(lse[rows], clean_lse[rows], "LSE of other query rows")
    assert torch.isnan(out[1, 0]).all() and torch.isnan(lse[1, 0])


# ------------------------------------------------------------------ the fused-kernel guard
def _leaky_kernel(q, k, v, layout, scale):
    """Masked softmax over all rows followed by one `P @ V` product: what a tiled kernel does inside a
    tile (masked probabilities are 0, and 0·NaN = NaN)."""
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    rows = torch.arange(q.shape[0])
    segment = layout.segment_ids
    visible = (segment[:, None] == segment[None, :]) & (rows[None, :] <= rows[:, None])
    logits = torch.einsum("nhd,mhd->nhm", q, k) * scale
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return torch.einsum("nhm,mhd->nhd", torch.exp(logits - lse[..., None]), v), lse


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_fused_guard_isolates_a_leaky_kernel(tensor):
    """`isolate_non_finite` around a kernel that leaks NaN values (checked): the guarded kernel equals the
    reference on every row, NaN where the reference is NaN."""
    layout = TokenLayout.packed(torch.tensor([0, 6, 11], dtype=torch.int32), 11, torch.device("cpu"))
    q, k, v = _qkv(11)
    bad = dict(q=q, k=k, v=v)
    bad[tensor] = bad[tensor].clone()
    bad[tensor][3, 1, 0] = float("nan")
    if tensor == "v":  # a masked NaN key only meets the mask; a NaN value meets 0 in the product
        leaked, _ = _leaky_kernel(bad["q"], bad["k"], bad["v"], layout, 0.3)
        assert torch.isnan(leaked[:3]).any(), "the unguarded kernel should leak into earlier rows"
    out, lse = isolate_non_finite(_leaky_kernel)(bad["q"], bad["k"], bad["v"], layout, 0.3)
    ref_out, ref_lse = causal_attention(bad["q"], bad["k"], bad["v"], layout, 0.3)
    torch.testing.assert_close(out, ref_out, equal_nan=True, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, equal_nan=True, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out[6:]).all() and torch.isfinite(out[:3]).all()


@pytest.mark.parametrize("value", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_fused_guard_gradients_equal_the_reference(tensor, value):
    """The guard's stand-ins pass their gradient through unchanged (no `isfinite` mask): q, k and v gradients
    of the guarded leaky kernel equal the reference's, 0 at the bad element and on every row only dead rows
    see, finite everywhere (a finite output gradient), in a packed layout with GQA."""
    layout = TokenLayout.packed(torch.tensor([0, 6, 11], dtype=torch.int32), 11, torch.device("cpu"))
    q, k, v = _qkv(11)
    bad = dict(q=q, k=k, v=v)
    bad[tensor] = bad[tensor].clone()
    bad[tensor][3, 1, 0] = BAD_VALUES[value]
    grad_out = torch.randn(11, q.shape[1], v.shape[2], dtype=F64)
    grads = {}
    for name, attend in (("guarded", isolate_non_finite(_leaky_kernel)), ("reference", causal_attention)):
        inputs = [t.detach().clone().requires_grad_() for t in (bad["q"], bad["k"], bad["v"])]
        out, _ = attend(*inputs, layout, 0.3)
        torch.where(torch.isnan(out), 0.0, out * grad_out).sum().backward()  # NaN rows: no gradient
        grads[name] = [t.grad for t in inputs]
    for name, got, expected in zip("qkv", grads["guarded"], grads["reference"]):
        assert torch.isfinite(got).all(), f"d{name}: non-finite"
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=f"d{name}")
    assert (grads["guarded"]["qkv".index(tensor)][3, 1] == 0).all()


# ------------------------------------------------------------------ GPU backends (lead runs these)
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn", "cudnn", "torch_sdpa", "triton"])
@pytest.mark.parametrize("layout_kind", ["batch", "packed"])
def test_fused_dense_backends_isolate_nan_on_gpu(backend, layout_kind):
    """Kind M on a fused CUDA backend, bf16 (skips when the backend declines this call): a NaN at token
    100 of sequence 0 (of 2 × 256) leaves tokens 0–99 and sequence 1 bit-identical to the clean run. The
    guard's passes ran as Triton kernels (counted once per call)."""
    from megatron_dsa.backends import BackendUnavailableError, reset_call_counts, variant_counts
    from megatron_dsa.config import HybridAttentionConfig
    from megatron_dsa import HybridAttention
    from megatron_dsa.packed_seq import PackedSeqParams

    config = HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern="M",
                                               attention_backend_overrides={"dense_attention": backend})
    try:
        layer = HybridAttention(config, kind="M").cuda().to(torch.bfloat16)
    except BackendUnavailableError as error:
        pytest.skip(f"the requested {backend} backend cannot run on this machine: {error}")  # e.g. not installed
    seqlen, hidden = 256, config.hidden_size
    x = torch.randn(seqlen, 2, hidden, device="cuda", dtype=torch.bfloat16)
    packed = None
    if layout_kind == "packed":
        x = x.transpose(0, 1).reshape(2 * seqlen, 1, hidden)
        packed = PackedSeqParams(cu_seqlens_q=torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32,
                                                            device="cuda"), max_seqlen_q=seqlen)
    grad_out = torch.randn_like(x)
    try:
        clean = _run(layer, x, grad_out, packed)
    except BackendUnavailableError as error:
        pytest.skip(f"the requested {backend} backend cannot run on this machine: {error}")  # e.g. not installed
    bad_x = x.clone()
    bad_x[100, 0] = float("nan")
    reset_call_counts()
    bad = _run(layer, bad_x, grad_out, packed)
    assert variant_counts().get(("triton", "dense_attention", "non_finite_guard"), 0) == 1, variant_counts()
    if layout_kind == "packed":
        earlier, other = slice(0, 100), slice(seqlen, 2 * seqlen)
        pick = lambda t, rows: t[rows, 0]  # noqa: E731
    else:
        earlier, other = (slice(0, 100), 0), (slice(None), 1)
        pick = lambda t, rows: t[rows]  # noqa: E731
    _assert_same(pick(bad.out, earlier), pick(clean.out, earlier), "earlier tokens")
    _assert_same(pick(bad.out, other), pick(clean.out, other), "the other sequence")
    _assert_same(pick(bad.grad, other), pick(clean.grad, other), "input gradient of the other sequence")
