"""Helpers for the packed-sequence (THD) tests, plus checks of the helpers themselves.

`pack(segments, pads, tail)` lays per-segment token rows out the way `megatron_dsa.packed_seq`
describes: segment `b` occupies its real rows, then `pads[b]` padding rows, and `tail` rows of
static capacity follow the last segment. Padding and tail rows are NaN by default, so any leak of
theirs into a real result shows up as a NaN or a mismatch.

`run_layer` does one forward + backward and collects everything the metamorphic tests compare:
output, input grad, every parameter grad, the indexer loss and the top-k selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import pytest
import torch
from torch import Tensor

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.packed_seq import PackedSeqParams

F64 = torch.float64
INDEXER_PREFIX = "core_attention.indexer."  # parameters trained only by the indexer KL loss

# Round-off level for float64 comparisons of two mathematically identical computations.
FP64_TOL = dict(rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------ layers
def make_config(kind: str, **overrides) -> HybridAttentionConfig:
    """A tiny one-layer config in which the window (8), compression (ratio 4 / 8) and the top-k (3)
    all truncate something for segments of a few dozen tokens."""
    values = dict(num_layers=1, layer_pattern=kind, csa_window_size=8, hca_compress_ratio=8,
                  dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.5, init_method_std=0.08)
    values.update(overrides)
    return HybridAttentionConfig.from_preset("tiny", **values)


def make_layer(kind: str, dtype: torch.dtype = F64, seed: int = 0, **overrides) -> HybridAttention:
    """A layer with every parameter random enough to matter: non-zero attention sinks and norm
    gains away from 1 (a test that passes with all-ones gains proves less)."""
    torch.manual_seed(seed)
    layer = HybridAttention(make_config(kind, **overrides), kind=kind)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("attn_sink"):
                param.copy_(torch.randn_like(param) * 1.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return layer.to(dtype)


def random_segments(lengths: Sequence[int], hidden: int, dtype: torch.dtype = F64,
                    device: Optional[torch.device] = None) -> list[Tensor]:
    return [torch.randn(length, hidden, dtype=dtype, device=device) for length in lengths]


# ------------------------------------------------------------------------------------------ packing
@dataclass
class Packed:
    """A packed batch: `hidden [T, 1, d]`, its `params`, and where each segment's rows are."""

    hidden: Tensor
    params: PackedSeqParams
    real: list[slice]  # real-token rows of segment b
    padding: list[slice]  # per-segment padding rows of segment b
    tail: slice  # static-capacity rows after the last segment
    pads: list[int]
    tail_rows: int

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def filler(self) -> Tensor:
        """`[T]` bool: padding or tail row (not a real token)."""
        mask = torch.ones(self.num_rows, dtype=torch.bool, device=self.hidden.device)
        for rows in self.real:
            mask[rows] = False
        return mask

    def like(self, per_segment: Sequence[Tensor], fill: Optional[float] = None) -> Tensor:
        """Pack other per-segment rows (e.g. output grads) with the same layout; filler rows are
        random (finite) unless `fill` is given."""
        return _stack(per_segment, self.pads, self.tail_rows, fill)

    def split(self, rows: Tensor) -> list[Tensor]:
        """The real rows of each segment of a packed `[T, 1, ...]` result, as `[L_b, ...]`."""
        return [rows[r, 0] for r in self.real]


def pack(segments: Sequence[Tensor], pads: Optional[Sequence[int]] = None, tail: int = 0,
         fill: float = float("nan"), padded_metadata: Optional[bool] = None,
         max_seqlen: object = "exact", cu_device: Optional[torch.device] = None) -> Packed:
    """Pack `[L_b, d]` segments into `[T, 1, d]` with `pads[b]` filler rows after segment `b` and
    `tail` filler rows at the end (filled with `fill`, NaN by default).

    padded_metadata: give `cu_seqlens_q_padded` (default: only when some pad is non-zero).
    max_seqlen: "exact" (longest physical segment), None (omitted) or an int upper bound.
    cu_device: where the cu_seqlens tensors live (default: the segments' device).
    """
    pads = list(pads) if pads is not None else [0] * len(segments)
    if len(pads) != len(segments):
        raise ValueError("one pad count per segment")
    lengths = [s.shape[0] for s in segments]
    real_cu, padded_cu, real, padding = [0], [0], [], []
    for length, pad in zip(lengths, pads):
        start = padded_cu[-1]
        real.append(slice(start, start + length))
        padding.append(slice(start + length, start + length + pad))
        real_cu.append(real_cu[-1] + length)
        padded_cu.append(start + length + pad)
    hidden = _stack(segments, pads, tail, fill)
    device = cu_device if cu_device is not None else hidden.device
    if padded_metadata is None:
        padded_metadata = any(pads)
    longest = max((b - a for a, b in zip(padded_cu, padded_cu[1:])), default=0)
    params = PackedSeqParams(
        cu_seqlens_q=torch.tensor(real_cu, dtype=torch.int32, device=device),
        cu_seqlens_q_padded=(torch.tensor(padded_cu, dtype=torch.int32, device=device)
                             if padded_metadata else None),
        max_seqlen_q=longest if max_seqlen == "exact" else max_seqlen)
    return Packed(hidden.unsqueeze(1), params, real, padding,
                  slice(padded_cu[-1], padded_cu[-1] + tail), pads, tail)


def _stack(segments: Sequence[Tensor], pads: Sequence[int], tail: int,
           fill: Optional[float]) -> Tensor:
    ref = segments[0]
    width = ref.shape[1:]

    def filler(rows: int) -> Tensor:
        if fill is None:
            return torch.randn(rows, *width, dtype=ref.dtype, device=ref.device)
        return torch.full((rows, *width), fill, dtype=ref.dtype, device=ref.device)

    parts = []
    for segment, pad in zip(segments, pads):
        parts += [segment, filler(pad)]
    parts.append(filler(tail))
    return torch.cat(parts)


# ------------------------------------------------------------------------------------------ running
@dataclass
class Run:
    """Everything one forward + backward produced (detached copies)."""

    out: Tensor
    grad_in: Tensor
    grads: dict[str, Tensor]  # every parameter; zeros where autograd left the grad None
    missing_grads: list[str]  # parameters whose .grad stayed None
    loss: Optional[Tensor]  # coefficient-scaled indexer loss (C layers with an indexer)
    window: Optional[Tensor]  # last_selection.window, global kv rows
    compressed: Optional[Tensor]  # last_selection.compressed, global kv rows (−1 = none)


def run_layer(layer: HybridAttention, hidden: Tensor, grad_out: Tensor,
              params: Optional[PackedSeqParams] = None) -> Run:
    hidden = hidden.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out, bias = layer(hidden, packed_seq_params=params)
    assert bias is None
    out.backward(grad_out)
    grads, missing = {}, []
    for name, param in layer.named_parameters():
        if param.grad is None:
            missing.append(name)
            grads[name] = torch.zeros_like(param)
        else:
            grads[name] = param.grad.detach().clone()
    loss = layer.last_indexer_loss
    selection = getattr(getattr(layer, "core_attention", None), "last_selection", None)
    return Run(out.detach(), hidden.grad.detach(), grads, missing,
               None if loss is None else loss.detach().clone(),
               None if selection is None else selection.window.clone(),
               None if selection is None or selection.compressed is None
               else selection.compressed.clone())


def run_packed(layer: HybridAttention, packed: Packed, grad_segments: Sequence[Tensor]) -> Run:
    return run_layer(layer, packed.hidden, packed.like(grad_segments).unsqueeze(1), packed.params)


def run_each(layer: HybridAttention, segments: Sequence[Tensor],
             grad_segments: Sequence[Tensor]) -> list[Optional[Run]]:
    """One SBHD `[L, 1, d]` call per segment (None for an empty segment: it has no tokens)."""
    return [run_layer(layer, x.unsqueeze(1), g.unsqueeze(1)) if x.shape[0] else None
            for x, g in zip(segments, grad_segments)]


@dataclass
class Expected:
    outs: list[Tensor]
    grads_in: list[Tensor]
    grads: dict[str, Tensor]
    loss: Optional[Tensor]


def combine_separate(layer: HybridAttention, runs: Sequence[Optional[Run]],
                     lengths: Sequence[int]) -> Expected:
    """What a packed run of the same segments must give, from one run per segment.

    Outputs and input grads are the per-segment ones. The main loss is a sum over tokens, so the
    non-indexer parameter grads add up. The indexer KL loss of segment b is
    `coeff · Σ_{t∈b} KL_t` (per-token mode) or `coeff · Σ_{t∈b} KL_t / L_b` (mean mode); the packed
    loss is `coeff · Σ_t KL_t` resp. `coeff · Σ_t KL_t / N` over the N = Σ L_b real rows. So
        per-token:  loss = Σ_b loss_b,                 indexer grads = Σ_b g_b
        mean:       loss = Σ_b (L_b / N) · loss_b,     indexer grads = Σ_b (L_b / N) · g_b
    (the packed mean is the row-weighted mean of the per-segment means; indexer parameters get
    gradient only from the KL loss, docs/math.md §6.1, §9).
    """
    config = layer.config
    total = sum(lengths)
    dtype = next(layer.parameters()).dtype
    width = config.hidden_size
    outs, grads_in = [], []
    grads = {name: torch.zeros_like(p) for name, p in layer.named_parameters()}
    losses = []
    for run, length in zip(runs, lengths):
        if run is None:
            empty = torch.zeros(0, width, dtype=dtype)
            outs.append(empty)
            grads_in.append(empty)
            continue
        outs.append(run.out[:, 0])
        grads_in.append(run.grad_in[:, 0])
        weight = 1.0 if config.calculate_per_token_loss else length / total
        for name, grad in run.grads.items():
            grads[name] += grad * (weight if name.startswith(INDEXER_PREFIX) else 1.0)
        if run.loss is not None:
            losses.append(run.loss * weight)
    loss = torch.stack(losses).sum() if losses else None
    return Expected(outs, grads_in, grads, loss)


# ------------------------------------------------------------------------------------------ asserts
def assert_close(actual: Tensor, expected: Tensor, what: str, **tol) -> None:
    torch.testing.assert_close(actual, expected, **(tol or FP64_TOL), msg=lambda m: f"{what}: {m}")


def assert_grads_close(actual: dict[str, Tensor], expected: dict[str, Tensor], what: str) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        assert_close(actual[name], expected[name], f"{what}: grad of {name}")


def assert_matches_separate(packed: Packed, run: Run, expected: Expected) -> None:
    """Real rows equal the separate calls; filler rows have exactly zero output and input grad."""
    for b, (out, grad_in) in enumerate(zip(packed.split(run.out), packed.split(run.grad_in))):
        assert_close(out, expected.outs[b], f"output of segment {b}")
        assert_close(grad_in, expected.grads_in[b], f"input grad of segment {b}")
    assert_filler_rows_zero(packed, run)
    assert_grads_close(run.grads, expected.grads, "summed param grads")
    assert_loss_matches(run.loss, expected.loss)


def assert_filler_rows_zero(packed: Packed, run: Run) -> None:
    filler = packed.filler
    assert torch.isfinite(run.out).all() and torch.isfinite(run.grad_in).all()
    assert torch.equal(run.out[filler], torch.zeros_like(run.out[filler])), \
        "padding/tail rows must give exactly zero output"
    assert torch.equal(run.grad_in[filler], torch.zeros_like(run.grad_in[filler])), \
        "padding/tail rows must get exactly zero input grad"
    for name, grad in run.grads.items():
        assert torch.isfinite(grad).all(), f"non-finite grad of {name}"


def assert_loss_matches(actual: Optional[Tensor], expected: Optional[Tensor]) -> None:
    assert (actual is None) == (expected is None), f"indexer loss {actual} vs expected {expected}"
    if actual is not None:
        assert torch.isfinite(actual)
        assert_close(actual, expected.to(actual.dtype), "indexer loss")


# ------------------------------------------------------------------------------------------ self-checks
def test_pack_layout_and_metadata():
    segments = [torch.full((length, 2), float(b + 1)) for b, length in enumerate([2, 0, 3])]
    packed = pack(segments, pads=[1, 2, 0], tail=3)
    p = packed.params
    assert p.cu_seqlens_q.tolist() == [0, 2, 2, 5]
    assert p.cu_seqlens_q_padded.tolist() == [0, 3, 5, 8]
    assert p.cu_seqlens_q.dtype == torch.int32 and p.max_seqlen_q == 3
    assert packed.hidden.shape == (11, 1, 2)
    assert [packed.hidden[r, 0, 0].tolist() for r in packed.real] == [[1.0, 1.0], [], [3.0] * 3]
    assert packed.filler.tolist() == [False, False, True, True, True, False, False, False,
                                      True, True, True]
    assert torch.isnan(packed.hidden[packed.filler]).all()
    grads = packed.like([torch.zeros(length, 2) for length in [2, 0, 3]])
    assert torch.isfinite(grads).all() and grads.shape == (11, 2)


def test_pack_without_padding_omits_padded_metadata():
    packed = pack([torch.randn(4, 3), torch.randn(1, 3)], max_seqlen=None)
    assert packed.params.cu_seqlens_q_padded is None and packed.params.max_seqlen_q is None
    assert packed.params.cu_seqlens_q.tolist() == [0, 4, 5] and not packed.filler.any()


@pytest.mark.parametrize("mean", [False, True])
def test_combine_separate_weights_indexer_terms(mean):
    """The expected-value helper weights indexer loss and grads by L_b / N in mean mode only."""
    layer = make_layer("C", calculate_per_token_loss=not mean)
    name = next(n for n, _ in layer.named_parameters() if n.startswith(INDEXER_PREFIX))
    other = "linear_proj.weight"

    def fake(value: float) -> Run:
        grads = {n: torch.full_like(p, value) for n, p in layer.named_parameters()}
        return Run(torch.zeros(1, 1, 128, dtype=F64), torch.zeros(1, 1, 128, dtype=F64), grads, [],
                   torch.tensor(value, dtype=F64), None, None)

    expected = combine_separate(layer, [fake(1.0), None, fake(4.0)], [1, 0, 3])
    w1, w3 = (0.25, 0.75) if mean else (1.0, 1.0)
    assert expected.loss.item() == pytest.approx(w1 * 1.0 + w3 * 4.0)
    assert expected.grads[name].flatten()[0].item() == pytest.approx(w1 * 1.0 + w3 * 4.0)
    assert expected.grads[other].flatten()[0].item() == pytest.approx(5.0)
