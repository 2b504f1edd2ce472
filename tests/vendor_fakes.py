"""CPU stand-ins for the vendor kernel modules (`cudnn`, `flash_mla`, `flash_attn.cute`).

Each fake implements its vendor's call contract with the reference math (so only our glue differs)
and asserts the input rules the real kernel has (int32 ids, tile-aligned widths, 64-head tiles, a
finite LSE, ...), recording every call so tests can check what the glue passed."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import torch
from torch import Tensor

from megatron_dsa.ops.dense_attention import causal_attention
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.sparse_attention import sparse_attention_backward, sparse_attention_forward


class FakeCudnnDSA:
    def __init__(self, index_alignment: int = 128):
        self.index_alignment = index_alignment
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def sparse_attention_backward_wrapper(self, q, kv, out, dout, lse, attn_sink, topk_idxs,
                                          softmax_scale=None, topk_length=None, **_):
        self.calls.append(("bwd", dict(q=q, lse=lse, sink=attn_sink, ids=topk_idxs, scale=softmax_scale)))
        assert q.shape[1] % 64 == 0 and topk_idxs.dtype == torch.int32
        assert topk_idxs.shape[1] % self.index_alignment == 0
        assert bool(((topk_idxs == -1) | ((topk_idxs >= 0) & (topk_idxs < kv.shape[0]))).all())
        assert torch.isfinite(lse).all(), "the kernel would produce NaN for a -inf lse"
        assert lse.dtype == torch.float32 and attn_sink.dtype == torch.float32
        dq, dkv, d_sink = sparse_attention_backward(q, kv, topk_idxs, attn_sink, softmax_scale, out, lse,
                                                    dout, None)
        return {"dq": dq, "dkv": dkv, "d_sink": d_sink}

    def indexer_top_k_wrapper(self, input_values, seq_lens, top_k, next_n=1, return_val=True,
                              deterministic=False, **_):
        """A correct top-k set per row over columns `[0, seq_len)` in a scrambled slot order (the real
        kernel promises no order); −inf columns inside seq_len may be picked, as a radix select does."""
        self.calls.append(("topk", dict(values=input_values, seq_lens=seq_lens, k=top_k)))
        rows, cols = input_values.shape
        assert cols % 8 == 0 and input_values.dtype == torch.float32 and seq_lens.dtype == torch.int32
        assert 0 < top_k <= 2048 and next_n == 1 and seq_lens.numel() == rows
        inside = torch.arange(cols) < seq_lens.long().unsqueeze(1)
        ranked = input_values.masked_fill(~inside, -math.inf)
        order = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :top_k]
        picked = torch.where(torch.gather(inside, 1, order), order, -1)
        return {"indices": picked.flip(1).to(torch.int32), "values": None}


    def indexer_forward_wrapper(self, q, k, w, ratio=4, sm_scale=1.0, cu_seqlens_q=None, cu_seqlens_k=None,
                                max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None, **_):
        """THD dense scores `sm_scale·Σ_h ReLU(<q_h, k_j>)·w_h` of every key of the row's segment, −inf
        from the ratio-causal limit `(offset + local row + 1) // ratio` on (and past the segment's keys)."""
        self.calls.append(("indexer_fwd", dict(q=q, k=k, w=w, ratio=ratio, scale=sm_scale, cu_q=cu_seqlens_q,
                                               cu_k=cu_seqlens_k, max_q=max_seqlen_q, max_k=max_seqlen_k,
                                               offsets=q_causal_offsets)))
        assert q.dtype == k.dtype == torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32)
        assert q.dim() == 3 and k.dim() == 3 and k.shape[1] == 1 and w.shape == q.shape[:2]
        assert q.shape[2] == k.shape[2] == 128 and q.shape[1] in (16, 32, 64)
        for t in (cu_seqlens_q, cu_seqlens_k, q_causal_offsets):
            assert t.dtype == torch.int32 and t.dim() == 1
        segments = cu_seqlens_q.shape[0] - 1
        assert cu_seqlens_k.shape[0] == segments + 1 and q_causal_offsets.shape[0] == segments
        assert int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0]
        out = torch.full((q.shape[0], max_seqlen_k), -math.inf)
        for b in range(segments):
            r0, r1, k0, k1 = (int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cu_seqlens_k[b]),
                              int(cu_seqlens_k[b + 1]))
            assert r1 - r0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
            dots = torch.einsum("thd,jd->thj", q[r0:r1].float(), k[k0:k1, 0].float())
            scores = sm_scale * (torch.relu(dots) * w[r0:r1].float().unsqueeze(-1)).sum(1)
            limit = (int(q_causal_offsets[b]) + torch.arange(r1 - r0) + 1) // ratio
            scores = torch.where(torch.arange(k1 - k0) < limit.unsqueeze(1), scores, -math.inf)
            out[r0:r1, :k1 - k0] = scores
        return {"scores": out}

    def indexer_backward_wrapper(self, index_q, weights, index_k, attn_score, index_score, topk_indices,
                                 grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128,
                                 topk_indices_global=False, d_index_q=None, d_weights=None,
                                 d_index_k=None, **_):
        """The documented math. Score gradient (written over attn_score, as the kernel does):
        `g − predict·Σg`, `g = −max(target, e^−100)·[predict ≥ e^−100]·loss_coeff·grad_loss/(B·S_q)`;
        then the backward of `Σ_h w_h·ReLU(sm_scale·<q_h, k>)` over the valid slots."""
        self.calls.append(("indexer_bwd", dict(q=index_q, w=weights, target=attn_score.clone(),
                                               predict=index_score, ids=topk_indices,
                                               grad_loss=grad_loss.clone(), scale=sm_scale)))
        batch, rows, heads, _ = index_q.shape
        assert index_q.dtype == weights.dtype == index_k.dtype == torch.bfloat16
        assert attn_score.dtype == index_score.dtype == torch.float32 and topk_indices.dtype == torch.int32
        assert heads >= 64 and topk_indices.shape[-1] % block_I == 0 and topk_indices_global
        assert grad_loss.shape == (1,) and grad_loss.dtype == torch.float32
        clip = math.exp(-100.0)
        g = -attn_score.clamp_min(clip) * (index_score >= clip) * loss_coeff * grad_loss / (batch * rows)
        attn_score.copy_(g - index_score * g.sum(-1, keepdim=True))
        keys_flat = index_k.reshape(-1, index_k.shape[-1]).float()
        valid = topk_indices >= 0
        keys = keys_flat[topk_indices.clamp_min(0).long()]  # [B, S, K, D]
        dots = torch.einsum("bshd,bskd->bshk", index_q.float(), keys) * sm_scale
        signal = (attn_score * valid).unsqueeze(2)  # [B, S, 1, K]
        grad_dots = signal * weights.float().unsqueeze(-1) * (dots > 0)
        dq = torch.einsum("bshk,bskd->bshd", grad_dots, keys) * sm_scale
        dw = (signal * torch.relu(dots)).sum(-1)
        dk = torch.zeros_like(keys_flat)
        dk.index_add_(0, torch.where(valid, topk_indices, 0).long().flatten(),
                      (torch.einsum("bshk,bshd->bskd", grad_dots, index_q.float()) * sm_scale).flatten(0, 2))
        d_index_k = torch.empty_like(index_k) if d_index_k is None else d_index_k
        d_index_k.copy_(dk.view(index_k.shape))
        return {"d_index_q": dq.to(index_q.dtype), "d_weights": dw.to(weights.dtype), "d_index_k": d_index_k}

    def sparse_attn_score_recompute_wrapper(self, q_attn, k_attn, lse, topk_indices, softmax_scale,
                                            qhead_per_kv_head=None, topk_length=None, topk_indices_global=False,
                                            **_):
        """The SM90 target: per slot `S = Σ_h exp(scale·<q_h, k[id]> − lse_h)` (0 at −1 slots), returned
        as `S / (Σ_slots S + 1e-10)` in float32 `[B, S_q, topk]`; global ids are `b·S_k + local`."""
        self.calls.append(("target", dict(q=q_attn, lse=lse, ids=topk_indices, scale=softmax_scale,
                                          ids_global=topk_indices_global)))
        batch, rows, heads, dim = q_attn.shape
        keys = k_attn.shape[1]
        assert k_attn.dim() == 3 and k_attn.shape[0] == batch and k_attn.shape[2] == dim
        assert q_attn.dtype == k_attn.dtype and lse.dtype == torch.float32 and lse.shape == (batch, rows, heads)
        assert heads % 64 == 0 and qhead_per_kv_head in (None, heads) and topk_length is None
        assert topk_indices.dtype == torch.int32 and topk_indices.shape[:2] == (batch, rows)
        assert topk_indices.shape[2] % 128 == 0, "SM90 normalises 128 slots at a time"
        offset = (torch.arange(batch) * keys).view(batch, 1, 1) if topk_indices_global else 0
        local = torch.where(topk_indices >= 0, topk_indices.long() - offset, -1)
        assert bool(((local == -1) | ((local >= 0) & (local < keys))).all()), "ids >= S_k are not masked"
        assert not torch.isneginf(lse).any() and not torch.isnan(lse).any()
        gathered = torch.stack([k_attn[b][local[b].clamp_min(0)] for b in range(batch)]).double()
        logits = torch.einsum("bshd,bskd->bshk", q_attn.double(), gathered) * softmax_scale
        mass = torch.exp(logits - lse.double().unsqueeze(-1)).sum(2) * (local >= 0)
        return {"target": (mass / (mass.sum(-1, keepdim=True) + 1e-10)).float()}


def fake_cudnn(dsa: FakeCudnnDSA) -> types.ModuleType:
    module = types.ModuleType("cudnn")
    module.__version__ = "1.32.0"
    module.DSA = dsa
    return module


class FakeFlashMLA(types.ModuleType):
    def __init__(self, lse_base2: bool = False):
        super().__init__("flash_mla")
        self.lse_base2 = lse_base2
        self.calls: list[dict[str, Any]] = []

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        self.calls.append(dict(q=q, ids=indices, sink=attn_sink, scale=sm_scale))
        assert q.shape[1] in (64, 128) and kv.dim() == 3 and kv.shape[1] == 1 and indices.shape[1] == 1
        assert indices.dtype == torch.int32 and indices.shape[-1] % 128 == 0 and d_v == kv.shape[-1]
        out, lse = sparse_attention_forward(q, kv[:, 0], indices[:, 0], attn_sink, sm_scale)
        lse = torch.where(torch.isneginf(lse), math.inf, lse).float()  # FlashMLA: +inf on empty rows
        if self.lse_base2:
            lse = lse / math.log(2.0)
        return out, lse.clone(), lse


def fake_flash_attn_cute(calls: list) -> types.ModuleType:
    """`flash_attn.cute.flash_attn_varlen_func` returning FA4's head-major `[H, T]` LSE."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, softmax_scale=None, causal=False, return_lse=False, **_):
        calls.append(dict(cu=cu_seqlens_q, max_seqlen=max_seqlen_q, causal=causal))
        assert causal and cu_seqlens_q.dtype == torch.int32 and int(cu_seqlens_q[-1]) == q.shape[0]
        layout = TokenLayout.packed(cu_seqlens_q, q.shape[0], q.device, max_seqlen=max_seqlen_q)
        out, lse = causal_attention(q, k, v, layout, softmax_scale)
        return out, lse.float().t().contiguous().detach()

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def install(monkeypatch, name: str, module: Any) -> None:
    """Put `module` in `sys.modules[name]` for this test (None makes the import fail)."""
    monkeypatch.setitem(sys.modules, name, module)


def fake_sparse_inputs(rows: int, heads: int, dim: int, kv_rows: int, width: int, dtype: torch.dtype,
                       seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Query, kv, indices (with −1, ids ≥ M and an empty row) and a ±4 sink (bug class A2.5)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    kv = torch.randn(kv_rows, dim, generator=gen, dtype=torch.float64).to(dtype)
    indices = torch.randint(0, kv_rows, (rows, width), generator=gen)
    indices[:, -1] = -1
    indices[0, 0] = kv_rows + 7  # ≥ M: invalid too (A4.4)
    indices[1] = -1  # a row without keys
    sink = torch.linspace(-4.0, 4.0, heads, dtype=torch.float32)
    return query, kv, indices, sink
