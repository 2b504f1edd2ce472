"""CPU stand-ins for the vendor kernel modules (`cudnn`, `flash_mla`, `flash_attn.cute` (FA4),
`flash_attn.flash_attn_interface` (FA2), `flash_attn_interface` (FA3)).

Each fake implements its vendor's call contract with the reference math (so only our glue differs)
and asserts the input rules the real kernel has (int32 ids, tile-aligned widths, 64-head tiles, a
finite LSE, ...), recording every call so tests can check what the glue passed."""

from __future__ import annotations

import math
import sys
import types
from typing import Any, Optional

import torch
from torch import Tensor

from megatron_dsa.ops.dense_attention import block_attention_backward, block_attention_forward, causal_attention
from megatron_dsa.ops.layout import TokenLayout
from megatron_dsa.ops.sparse_attention import sparse_attention_backward, sparse_attention_forward


class FakeCudnnDSA:
    # (heads, D) the SM100 sparse forward is built for; its output keeps the first 512 dims (V) either way.
    FORWARD_VARIANTS = ((64, 512), (64, 576), (128, 512))
    FORWARD_VALUE_DIM = 512

    def __init__(self, index_alignment: int = 128):
        self.index_alignment = index_alignment
        self.forward_lse_base2 = False  # True fakes a broken forward (for the adapter's self-test to catch)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def sparse_attention_forward_wrapper(self, q, kv, topk_idxs, *, attn_sink=None, topk_length=None,
                                         softmax_scale=None, indexer_topk=0, stream=None):
        """The SM100 sparse forward: a slot is a key when `0 <= id < M` (any other id is skipped), the sink
        enters only the output's normaliser, lse is natural-log and sink-free; a row without keys gives
        out 0 and lse +inf."""
        self.calls.append(("fwd", dict(q=q, kv=kv, ids=topk_idxs, sink=attn_sink, scale=softmax_scale)))
        rows, heads, dim = q.shape
        assert q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
        assert (heads, dim) in self.FORWARD_VARIANTS and kv.dim() == 2 and kv.shape[1] == dim
        assert topk_idxs.dtype == torch.int32 and topk_idxs.dim() == 2 and topk_idxs.shape[0] == rows
        assert attn_sink is not None and attn_sink.dtype == torch.float32 and attn_sink.shape == (heads,)
        assert topk_length is None and indexer_topk == 0 and stream is None  # what our glue passes
        scale = 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale
        out, lse = sparse_attention_forward(q, kv, topk_idxs, attn_sink, scale)
        empty = ~((topk_idxs >= 0) & (topk_idxs < kv.shape[0])).any(1)
        out = out[..., :self.FORWARD_VALUE_DIM].masked_fill(empty.view(-1, 1, 1), 0.0)
        lse = lse.float().masked_fill(empty.unsqueeze(1), math.inf)
        if self.forward_lse_base2:
            lse = lse / math.log(2.0)
        return {"out": out, "max_logits": None, "lse": lse, "lse_indexer": None}  # max_logits: unread by the glue

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
        self.last_topk = picked.flip(1).to(torch.int32)
        return {"indices": self.last_topk, "values": None}


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


class FakeFlashMLADecode(FakeFlashMLA):
    """FlashMLA with its FP8 sparse decode (`flash_mla_with_kvcache`), written from FlashMLA's own description of
    the DeepSeek-V4 ("MODEL1") cache, not from `ops.paged_rows`: a cache block of `page` tokens at
    `block · stride(0)` bytes, token t's 448 e4m3 values and 64 bfloat16 RoPE values at `t · 576`, its 7 e8m0
    scales (+1 pad byte) at `page · 576 + t · 8`; ids `block · page + t`, −1 or past `topk_length` skipped; the
    sink scales the output by `exp(lse) / (exp(lse) + exp(sink))`. Asserts the call's shapes and dtypes as its
    C++ checks do."""

    def get_mla_metadata(self, *args, **kwargs):
        return types.SimpleNamespace(have_initialized=False), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                               indices=None, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                               topk_length=None, extra_topk_length=None):
        batch, s_q, heads, d_qk = q.shape
        assert q.dtype == torch.bfloat16 and s_q == 1 and heads in (64, 128) and d_qk == 512 and head_dim_v == 512
        assert is_fp8_kvcache and not causal and block_table is None and cache_seqlens is None
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (heads,)
        self.calls.append(dict(heads=heads, extra=extra_k_cache is not None, lengths=topk_length is not None))
        keys, valid = [], []
        for cache, ids, lengths in ((k_cache, indices, topk_length), (extra_k_cache, extra_indices_in_kvcache,
                                                                       extra_topk_length)):
            if cache is None:
                continue
            assert cache.dtype == torch.uint8 and cache.shape[2:] == (1, 584) and cache.stride(1) == 584
            assert ids.dtype == torch.int32 and ids.shape[:2] == (batch, 1) and ids.shape[2] % 64 == 0
            ids = ids[:, 0].long()
            ok = ids >= 0
            if lengths is not None:
                assert lengths.dtype == torch.int32 and lengths.shape == (batch,)
                ok &= torch.arange(ids.shape[1]) < lengths.long().unsqueeze(1)
            page = cache.shape[1]
            flat = cache.as_strided((cache.shape[0] * cache.stride(0),), (1,))  # the storage the view starts at
            block, token = torch.where(ok, ids, 0) // page, torch.where(ok, ids, 0) % page
            start = (block * cache.stride(0) + token * 576).unsqueeze(-1)
            row = flat[start + torch.arange(576)]  # [B, K, 576]
            scale_start = (block * cache.stride(0) + page * 576 + token * 8).unsqueeze(-1)
            exponents = flat[scale_start + torch.arange(7)].long() - 127  # [B, K, 7]
            nope = row[..., :448].contiguous().view(torch.float8_e4m3fn).double().unflatten(-1, (7, 64))
            nope = (nope * torch.pow(2.0, exponents.double()).unsqueeze(-1)).flatten(-2)
            rope_values = row[..., 448:].contiguous().view(torch.bfloat16).double()
            keys.append(torch.cat((nope, rope_values), dim=-1))
            valid.append(ok)
        keys, valid = torch.cat(keys, dim=1), torch.cat(valid, dim=1)  # [B, K, 512], [B, K]
        logits = torch.einsum("bhd,bkd->bhk", q[:, 0].double(), keys) * softmax_scale
        logits = logits.masked_fill(~valid.unsqueeze(1), -math.inf)
        lse = torch.logsumexp(logits, dim=-1)  # [B, H]
        out = torch.einsum("bhk,bkd->bhd", torch.exp(logits - lse.unsqueeze(-1)), keys)
        out = out * torch.sigmoid(lse - attn_sink.double()).unsqueeze(-1)  # exp(lse) / (exp(lse) + exp(sink))
        return out.unsqueeze(1).to(q.dtype), lse.unsqueeze(-1).float()


def fake_flash_attn_cute(calls: list) -> types.ModuleType:
    """`flash_attn.cute.flash_attn_varlen_func` returning FA4's head-major `[H, T]` LSE: the layer's causal
    packed call (one `cu_seqlens` for queries and keys) or a ring block (one segment, causal or not)."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, softmax_scale=None, causal=False, return_lse=False, **_):
        calls.append(dict(cu=cu_seqlens_q, cu_k=cu_seqlens_k, max_seqlen=max_seqlen_q, causal=causal))
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and int(cu_seqlens_q[-1]) == q.shape[0]
        assert int(cu_seqlens_k[-1]) == k.shape[0] and (causal or cu_seqlens_k is not cu_seqlens_q)
        if cu_seqlens_k is cu_seqlens_q:  # the layer's packed causal call
            layout = TokenLayout.packed(cu_seqlens_q, q.shape[0], q.device, max_seqlen=max_seqlen_q)
            out, lse = causal_attention(q, k, v, layout, softmax_scale)
        else:  # one block of the context-parallel ring: one segment each
            assert cu_seqlens_q.tolist() == [0, q.shape[0]] and cu_seqlens_k.tolist() == [0, k.shape[0]]
            out, lse = block_attention_forward(q, k, v, softmax_scale, causal)
            out = out.to(q.dtype)
        return out, lse.float().t().contiguous().detach()

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def fake_flash_attn_cute_interface(calls: list) -> types.ModuleType:
    """`flash_attn.cute.interface._flash_attn_bwd`: batched `[B, S, H, D]` tensors, `lse [B, H, S]` float32,
    one dtype for q, k, v, out and dout; returns `(dq, dk, dv)` in that dtype."""

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, **_):
        calls.append(dict(causal=causal, scale=softmax_scale, lse=lse))
        assert q.dim() == 4 and q.shape[0] == 1 and lse.shape == (1, q.shape[2], q.shape[1])
        assert q.dtype == k.dtype == v.dtype == out.dtype == dout.dtype and lse.dtype == torch.float32
        grads = block_attention_backward(q[0], k[0], v[0], out[0], lse[0].t(), dout[0], softmax_scale, causal)
        return tuple(g.to(q.dtype).unsqueeze(0) for g in grads)

    module = types.ModuleType("flash_attn.cute.interface")
    module._flash_attn_bwd = _flash_attn_bwd
    return module


def _flash_attn_varlen(calls: list, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale, causal, corrupt: Optional[str]) -> tuple[Tensor, Tensor]:
    """FA2/FA3 `flash_attn_varlen_func` math with the input rules both kernels check: fp16/bf16 with
    one dtype, last dims contiguous, int32 contiguous `cu_seqlens` from 0 to T on q's device, every
    segment within `max_seqlen` (the kernels launch row blocks only up to it), G | H, head dims ≤ 256
    and multiples of 8. Returns `out [T, H, Dv]` (q dtype) and the natural-log `lse [H, T]` float32,
    still attached to the graph (the real autograd functions ignore its gradient; the glue detaches).
    `corrupt` ("out" or "lse") fakes a broken build for the self-test to catch."""
    calls.append(dict(cu=cu_seqlens_q, max_seqlen=max_seqlen_q, causal=causal, scale=softmax_scale,
                      q=q, k=k, v=v))
    assert q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert softmax_scale is not None
    for cu, rows, longest in ((cu_seqlens_q, q.shape[0], max_seqlen_q), (cu_seqlens_k, k.shape[0], max_seqlen_k)):
        assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == q.device
        assert int(cu[0]) == 0 and int(cu[-1]) == rows
        assert int((cu[1:] - cu[:-1]).max()) <= longest, "rows past max_seqlen are skipped"
    assert q.shape[1] % k.shape[1] == 0 and k.shape[:2] == v.shape[:2] and k.shape[2] == q.shape[2]
    assert max(q.shape[2], v.shape[2]) <= 256 and q.shape[2] % 8 == 0 and v.shape[2] % 8 == 0
    if cu_seqlens_k is cu_seqlens_q:  # the layer's packed causal call
        assert causal and max_seqlen_k == max_seqlen_q
        layout = TokenLayout.packed(cu_seqlens_q, q.shape[0], q.device, max_seqlen=max_seqlen_q)
        out, lse = causal_attention(q, k, v, layout, softmax_scale)
    else:  # one block of the context-parallel ring: one segment each
        assert cu_seqlens_q.numel() == cu_seqlens_k.numel() == 2
        out, lse = block_attention_forward(q, k, v, softmax_scale, causal)
        out = out.to(q.dtype)
    if corrupt == "out":
        out = out * 1.25
    if corrupt == "lse":
        lse = lse + 0.25
    return out, lse.float().t().contiguous()


def fake_flash_attn_2(calls: list, version: str = "2.8.3", corrupt: Optional[str] = None) -> dict[str, Any]:
    """The modules of `flash-attn` 2.x: the `flash_attn` package (its `__version__`) and
    `flash_attn.flash_attn_interface.flash_attn_varlen_func`, which with `return_attn_probs=True` returns
    `(out, lse [H, T], None)` (no dropout: no probabilities) and needs one head dim for q, k and v."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert q.shape[2] == v.shape[2], "FA2: q, k and v share one head dim"
        assert dropout_p == 0.0 and window_size == (-1, -1) and alibi_slopes is None and block_table is None
        out, lse = _flash_attn_varlen(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal, corrupt)
        return (out, lse, None) if return_attn_probs else out

    package = types.ModuleType("flash_attn")
    package.__version__ = version
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.flash_attn_varlen_func = flash_attn_varlen_func
    package.flash_attn_varlen_func = flash_attn_varlen_func
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


def fake_flash_attn_3(calls: list, api: str = "return_attn_probs", corrupt: Optional[str] = None) -> dict[str, Any]:
    """The `flash_attn_interface` module of a FlashAttention-3 (hopper/) build. Its varlen function
    takes unequal head dims only as qk (128, 192] with v (96, 128], or qk <= 64. `api` picks the build:
    "return_attn_probs" (Aug 2025 on: `(out, lse)` when asked), "always" (earlier: always `(out, lse)`,
    no such keyword), "out_only" (Jul-Aug 2025: `out` alone, no keyword)."""

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        qk, dv = q.shape[2], v.shape[2]
        assert qk == dv or (128 < qk <= 192 and 96 < dv <= 128) or qk <= 64, "FA3 rejects these head dims"
        return _flash_attn_varlen(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, corrupt)

    def with_keyword(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                     seqused_k=None, softmax_scale=None, causal=False, deterministic=False, return_attn_probs=False):
        out, lse = run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        return (out, lse) if return_attn_probs else out

    def always(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
               softmax_scale=None, causal=False, deterministic=False):
        return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)

    def out_only(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
                 softmax_scale=None, causal=False, deterministic=False):
        return always(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
                      causal=causal)[0]

    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_varlen_func = {"return_attn_probs": with_keyword, "always": always, "out_only": out_only}[api]
    return {"flash_attn_interface": module}


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
