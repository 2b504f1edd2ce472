"""`attention_mask` is honoured or rejected, never ignored.

Metamorphic: a Megatron document mask (`--reset-attention-mask`: causal within documents) gives
every document exactly what it gets alone (output, input gradient, parameter gradients; positions
restart; per-token indexer loss, so separate calls' losses add up), the causal mask equals no mask, and every other mask, shape or dtype raises a clear error.
fp64, so the only differences are summation order (1e-12).
"""

from __future__ import annotations

import pytest
import torch

from megatron_dsa import HybridAttention, HybridAttentionConfig
from megatron_dsa.packed_seq import PackedSeqParams, documents_from_attention_mask

SEQ = 40
DOCUMENTS = ([15, 25], [40])  # per batch row: its documents' lengths


def layer_of(kind: str) -> HybridAttention:
    config = HybridAttentionConfig.from_preset("tiny", num_layers=1, layer_pattern=kind, csa_window_size=8,
                                               hca_compress_ratio=8, dsa_indexer_topk=3,
                                               dsa_indexer_loss_coeff=0.5, calculate_per_token_loss=True)
    torch.manual_seed(3)
    layer = HybridAttention(config, kind=kind).double()
    if hasattr(layer, "core_attention"):
        with torch.no_grad():
            layer.core_attention.attn_sink.normal_()
    return layer


def document_mask(rows: tuple[list[int], ...]) -> torch.Tensor:
    """Megatron's mask `[B, 1, S, S]`, True = masked: causal within each row's documents."""
    masks = []
    for lengths in rows:
        document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        masks.append(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1) | (document[:, None] != document[None, :]))
    return torch.stack(masks)[:, None]


def grads(layer: HybridAttention) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", "WCHM")
def test_document_mask_equals_separate_documents(kind: str) -> None:
    layer = layer_of(kind)
    x = torch.randn(SEQ, len(DOCUMENTS), layer.config.hidden_size, dtype=torch.float64)
    upstream = torch.randn_like(x)
    masked_in = x.clone().requires_grad_()
    out, _ = layer(masked_in, attention_mask=document_mask(DOCUMENTS))
    (out * upstream).sum().backward()
    masked_grads = grads(layer)
    layer.zero_grad()
    separate_in = x.clone().requires_grad_()
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for length in lengths:
            piece = separate_in[start:start + length, row:row + 1]
            alone, _ = layer(piece)
            torch.testing.assert_close(out[start:start + length, row:row + 1], alone, rtol=0, atol=1e-12)
            (alone * upstream[start:start + length, row:row + 1]).sum().backward()
            start += length
    torch.testing.assert_close(masked_in.grad, separate_in.grad, rtol=0, atol=1e-12)
    for name, grad in grads(layer).items():
        torch.testing.assert_close(masked_grads[name], grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("kind", "WC")
def test_causal_mask_equals_no_mask(kind: str) -> None:
    layer = layer_of(kind)
    x = torch.randn(SEQ, 2, layer.config.hidden_size, dtype=torch.float64)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    for mask in (causal, causal[None, None], causal.expand(2, 1, SEQ, SEQ)):
        torch.testing.assert_close(layer(x, attention_mask=mask)[0], layer(x)[0], rtol=0, atol=0)


def test_masks_the_layer_cannot_honour_raise() -> None:
    layer = layer_of("C")
    x = torch.randn(SEQ, 2, layer.config.hidden_size, dtype=torch.float64)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    skipping = causal.clone()
    skipping[30, 5] = True  # a hole inside a document
    bidirectional = torch.zeros(SEQ, SEQ, dtype=torch.bool)
    for mask in (skipping, bidirectional, torch.ones(SEQ, SEQ, dtype=torch.bool)):
        with pytest.raises(ValueError, match="causal within documents"):
            layer(x, attention_mask=mask)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B=2 or 1, 1, S=40"):
        layer(x, attention_mask=causal[:20, :20])
    with pytest.raises(TypeError, match="bool"):
        layer(x, attention_mask=causal.double())
    packed = PackedSeqParams(cu_seqlens_q=torch.tensor([0, SEQ], dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        layer(x[:, :1], attention_mask=causal, packed_seq_params=packed)


def test_documents_from_attention_mask_boundaries() -> None:
    assert documents_from_attention_mask(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), 2, SEQ) is None
    assert documents_from_attention_mask(document_mask(DOCUMENTS), 2, SEQ).tolist() == [0, 15, 40, 80]
