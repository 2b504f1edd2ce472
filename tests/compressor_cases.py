"""Inputs shared by the Triton gated-pooling tests (interpreted on CPU, compiled on GPU)."""

from typing import Optional, Sequence

import torch

from megatron_dsa.ops.compressor import channel_factor
from megatron_dsa.ops.layout import CompressedLayout, TokenLayout


def cumulative(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.long)


def packed_layout(ratio: int, real: Sequence[int], padded: Optional[Sequence[int]] = None, tail_rows: int = 0,
                  device="cpu") -> CompressedLayout:
    """Segments of `real` tokens, each in `padded` physical rows (default: no padding), then `tail_rows`
    rows that belong to no segment (the capacity tail of a fixed-size buffer)."""
    physical = cumulative(padded if padded is not None else real)
    tokens = TokenLayout.packed(cumulative(real), int(physical[-1]) + tail_rows, torch.device(device),
                                cu_seqlens_padded=physical)
    return tokens.compressed(ratio)


def inputs(tokens: int, dc: int, ratio: int, dtype=torch.float32, ape_dtype=None, device="cpu", seed=0):
    """kv, gate `[T, coff·Dc]` in `dtype` and ape `[r, coff·Dc]` in `ape_dtype` (default: dtype), all
    requiring grad. Gate logits of a few units, so that the softmax weights are far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    width = channel_factor(ratio) * dc
    kv = torch.randn(tokens, width, generator=gen).to(device, dtype).requires_grad_()
    gate = (2.0 * torch.randn(tokens, width, generator=gen)).to(device, dtype).requires_grad_()
    ape = (0.5 * torch.randn(ratio, width, generator=gen)).to(device, ape_dtype or dtype).requires_grad_()
    return kv, gate, ape


def run(fn, kv, gate, ape, layout: CompressedLayout, upstream: torch.Tensor):
    """Pooled entries and the grads of (kv, gate, ape) for `Σ upstream·out`."""
    out = fn(kv, gate, ape, layout)
    return out, torch.autograd.grad((out * upstream).sum(), (kv, gate, ape))


def compress_projected(compress, leaves, args):
    """`compress(kv, gate, ape, norm_weight, *args)` from leaves `(x, wkv, wgate, ape, norm_weight)`, with kv
    and gate taken as the layer takes them: column slices of one stacked projection `x @ [Wkv; Wgate]^T`."""
    x, wkv, wgate, ape, norm_weight = leaves
    kv, gate = (x @ torch.cat((wkv, wgate)).T).split(wkv.shape[0], dim=1)
    return compress(kv, gate, ape, norm_weight, *args)
