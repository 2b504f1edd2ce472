"""`HybridLM`: a small byte-level decoder-only language model built on `HybridAttention`.

    tokens [B, S] → embedding → N × (RMSNorm → HybridAttention → + → RMSNorm → SwiGLU MLP → +)
                  → final RMSNorm → LM head → logits [B, S, V]

The residual stream is `[S, B, d]` (sequence first, as Megatron and `HybridAttention` expect).
Module names follow Megatron-Core's GPT model (`decoder.layers.{i}.self_attention`, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_dsa.config import HybridAttentionConfig, check_field_types, construct_strict
from megatron_dsa.layers.common import RMSNorm, linear, output_init_std
from megatron_dsa.layers.decoding import InferenceCache, LayerCache
from megatron_dsa.layers.hybrid_attention import HybridAttention
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.parallel.linear import ColumnParallelLinear, RowParallelLinear
from megatron_dsa.parallel.mappings import (gather_from_sequence_parallel_region,
                                            scatter_to_sequence_parallel_region)
from megatron_dsa.parallel.state import ParallelState

SEQUENCE_PARALLEL_GRAD = "sequence_parallel_grad"  # weight gradient is partial over TP under SP

BYTE_VOCAB_SIZE = 256


@dataclass
class ModelConfig:
    """Everything of the language model that is not attention (width and depth come from attention)."""

    vocab_size: int = BYTE_VOCAB_SIZE
    ffn_hidden_size: int = 384  # SwiGLU inner width F
    max_seq_len: int = 256  # longest input accepted (no learned positions: RoPE lives in attention)
    tie_embeddings: bool = True  # LM head reuses the embedding matrix

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("vocab_size", "ffn_hidden_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        return construct_strict(cls, values)


class SwiGLUMLP(nn.Module):
    """`x [S, B, d]` → `W2 (silu(x W_gate) ⊙ x W_up)`; gate/up column-parallel, W2 row-parallel.

    Gate and up are separate linears so that tensor parallelism splits each of them into matching
    blocks. Under sequence parallelism `x` is this rank's slice of S: it is gathered first and the
    output reduce-scattered.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, std: float, num_layers: int,
                 state: ParallelState, sequence_parallel: bool):
        super().__init__()
        tp = state.tp_group
        self.sp_group = tp if sequence_parallel else None
        self.linear_fc1_gate = ColumnParallelLinear(hidden_size, ffn_hidden_size, tp, std, "ffn_hidden_size")
        self.linear_fc1_up = ColumnParallelLinear(hidden_size, ffn_hidden_size, tp, std, "ffn_hidden_size")
        self.linear_fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, tp,
                                            output_init_std(std, num_layers), sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        # The column-parallel linears sum their input gradients over TP, so every rank's gradient of
        # the gathered input is complete: the gather's backward keeps the own slice.
        x = gather_from_sequence_parallel_region(x, self.sp_group, grad_is_partial=False)
        return self.linear_fc2(F.silu(self.linear_fc1_gate(x)) * self.linear_fc1_up(x))


class TransformerLayer(nn.Module):
    """Pre-norm block: `h [S, B, d]` → `h + attn(norm(h))` → `+ mlp(norm(·))`, `[S, B, d]`."""

    def __init__(self, attention: HybridAttentionConfig, model: ModelConfig, layer_number: int,
                 state: ParallelState):
        super().__init__()
        eps = attention.layernorm_epsilon
        self.input_layernorm = sequence_parallel_norm(attention, eps)
        self.self_attention = HybridAttention(attention, layer_number=layer_number, parallel_state=state)
        self.pre_mlp_layernorm = sequence_parallel_norm(attention, eps)
        self.mlp = SwiGLUMLP(attention.hidden_size, model.ffn_hidden_size, attention.init_method_std,
                             attention.num_layers, state, attention.sequence_parallel)

    def forward(self, hidden: Tensor, packed_seq_params: Optional[PackedSeqParams] = None,
                inference_cache: Optional[LayerCache] = None) -> Tensor:
        attended, _ = self.self_attention(self.input_layernorm(hidden), packed_seq_params=packed_seq_params,
                                          inference_cache=inference_cache)
        hidden = hidden + attended
        return hidden + self.mlp(self.pre_mlp_layernorm(hidden))


def sequence_parallel_norm(attention: HybridAttentionConfig, eps: float) -> RMSNorm:
    """An RMSNorm; under sequence parallelism it sees only this rank's rows, so its weight gradient
    is partial and must be summed over TP (`SEQUENCE_PARALLEL_GRAD` marks it)."""
    norm = RMSNorm(attention.hidden_size, eps, attention)
    if attention.sequence_parallel:
        setattr(norm.weight, SEQUENCE_PARALLEL_GRAD, True)
    return norm


class HybridLM(nn.Module):
    """Decoder-only LM with one `HybridAttention` per layer, kinds from `attention.layer_pattern`.

    forward(tokens `[B, S]` int64) → logits `[B, S, vocab_size]` (float32 under autocast too). With an
    `inference_cache` (`new_inference_cache`) the tokens continue the cached sequences (see
    `megatron_dsa.generate`).
    """

    def __init__(self, attention: HybridAttentionConfig, model: ModelConfig,
                 parallel_state: Optional[ParallelState] = None):
        super().__init__()
        state = parallel_state or ParallelState()
        self.attention_config, self.model_config, self.parallel_state = attention, model, state
        std = attention.init_method_std
        self.word_embeddings = nn.Embedding(model.vocab_size, attention.hidden_size)
        nn.init.normal_(self.word_embeddings.weight, std=std)
        self.layers = nn.ModuleList(TransformerLayer(attention, model, layer_number=i + 1, state=state)
                                    for i in range(attention.num_layers))
        self.final_layernorm = sequence_parallel_norm(attention, attention.layernorm_epsilon)
        self.output_layer = (None if model.tie_embeddings
                             else linear(attention.hidden_size, model.vocab_size, std))

    def forward(self, tokens: Tensor, packed_seq_params: Optional[PackedSeqParams] = None,
                inference_cache: Optional[InferenceCache] = None) -> Tensor:
        """tokens `[B, S]` (under context parallelism: this rank's part of S) → logits `[B, S, V]`.

        `inference_cache` (inference only): `tokens` are the next tokens of its sequences (`[B, S]`: S
        more each; packed `[1, T]`: segment b continues sequence b); the cache then holds them too."""
        if inference_cache is None:
            self._check_tokens(tokens, packed_seq_params)
        elif len(inference_cache.layers) != len(self.layers):
            raise ValueError(f"inference_cache has {len(inference_cache.layers)} layers, the model {len(self.layers)}")
        sp_group = self.parallel_state.tp_group if self.attention_config.sequence_parallel else None
        hidden = self.word_embeddings(tokens.t())  # [S, B, d]
        hidden = scatter_to_sequence_parallel_region(hidden, sp_group)
        for number, layer in enumerate(self.layers):
            hidden = layer(hidden, packed_seq_params,
                           None if inference_cache is None else inference_cache.layers[number])
        hidden = self.final_layernorm(hidden)
        # Every rank computes all logits with the replicated head: its gradient is complete.
        hidden = gather_from_sequence_parallel_region(hidden, sp_group, grad_is_partial=False)
        head = self.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        return F.linear(hidden.transpose(0, 1), head).float()

    def new_inference_cache(self, batch: int, capacity: Optional[int] = None,
                            fp8_indexer_keys: bool = False, fp8_attention_rows: bool = False) -> InferenceCache:
        """An empty decoding cache for `batch` sequences of up to `capacity` tokens (default
        `model.max_seq_len`), in the parameters' dtype and device (`fp8_indexer_keys`: C layers' indexer keys in
        e4m3 with a scale per key; `fp8_attention_rows`: W/C/H layers' attention rows in e4m3 pages;
        `LayerCache.for_layer`)."""
        capacity = self.model_config.max_seq_len if capacity is None else capacity
        if capacity > self.model_config.max_seq_len:
            raise ValueError(f"inference cache capacity {capacity} exceeds model.max_seq_len "
                             f"{self.model_config.max_seq_len}")
        return InferenceCache.for_layers([layer.self_attention for layer in self.layers], batch, capacity,
                                         fp8_indexer_keys=fp8_indexer_keys, fp8_attention_rows=fp8_attention_rows)

    def indexer_losses(self) -> dict[int, float]:
        """`{layer_number: coefficient-scaled indexer KL}` of the last training forward (C layers only)."""
        losses = {}
        for layer in self.layers:
            attention = layer.self_attention
            if attention.last_indexer_loss is not None:
                losses[attention.layer_number] = float(attention.last_indexer_loss)
        return losses

    def _check_tokens(self, tokens: Tensor, packed: Optional[PackedSeqParams]) -> None:
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be int64 [B, S], got {tokens.dtype} {tuple(tokens.shape)}")
        # Packed input is one [1, T] stream: its documents, not the stream, must fit.
        longest = tokens.shape[1] * self.parallel_state.cp_size if packed is None else packed.max_seqlen_q
        if longest is not None and longest > self.model_config.max_seq_len:
            raise ValueError(f"sequence length {longest} exceeds model.max_seq_len "
                             f"{self.model_config.max_seq_len}")
