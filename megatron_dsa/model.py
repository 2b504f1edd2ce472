"""`HybridLM`: a small byte-level decoder-only language model built on `HybridAttention`.

    tokens [B, S] → embedding → N × (RMSNorm → HybridAttention → + → RMSNorm → SwiGLU MLP → +)
                  → final RMSNorm → LM head → logits [B, S, V]

The residual stream is `[S, B, d]` (sequence first, as Megatron and `HybridAttention` expect).
Module names follow Megatron-Core's GPT model (`decoder.layers.{i}.self_attention`, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.layers.common import RMSNorm, linear, output_init_std
from megatron_dsa.layers.hybrid_attention import HybridAttention

BYTE_VOCAB_SIZE = 256


@dataclass
class ModelConfig:
    """Everything of the language model that is not attention (width and depth come from attention)."""

    vocab_size: int = BYTE_VOCAB_SIZE
    ffn_hidden_size: int = 384  # SwiGLU inner width F
    max_seq_len: int = 256  # longest input accepted (no learned positions: RoPE lives in attention)
    tie_embeddings: bool = True  # LM head reuses the embedding matrix

    def __post_init__(self) -> None:
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
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {unknown}")
        return cls(**values)


class SwiGLUMLP(nn.Module):
    """`x [..., d]` → `W2 (silu(x W_gate) ⊙ x W_up)` `[..., d]`; gate and up share one fc1 matmul."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, std: float, num_layers: int):
        super().__init__()
        self.linear_fc1 = linear(hidden_size, 2 * ffn_hidden_size, std)
        self.linear_fc2 = linear(ffn_hidden_size, hidden_size, output_init_std(std, num_layers))

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class TransformerLayer(nn.Module):
    """Pre-norm block: `h [S, B, d]` → `h + attn(norm(h))` → `+ mlp(norm(·))`, `[S, B, d]`."""

    def __init__(self, attention: HybridAttentionConfig, model: ModelConfig, layer_number: int):
        super().__init__()
        eps = attention.layernorm_epsilon
        self.input_layernorm = RMSNorm(attention.hidden_size, eps)
        self.self_attention = HybridAttention(attention, layer_number=layer_number)
        self.pre_mlp_layernorm = RMSNorm(attention.hidden_size, eps)
        self.mlp = SwiGLUMLP(attention.hidden_size, model.ffn_hidden_size, attention.init_method_std,
                             attention.num_layers)

    def forward(self, hidden: Tensor) -> Tensor:
        attended, _ = self.self_attention(self.input_layernorm(hidden))
        hidden = hidden + attended
        return hidden + self.mlp(self.pre_mlp_layernorm(hidden))


class HybridLM(nn.Module):
    """Decoder-only LM with one `HybridAttention` per layer, kinds from `attention.layer_pattern`.

    forward(tokens `[B, S]` int64) → logits `[B, S, vocab_size]` (float32 under autocast too).
    """

    def __init__(self, attention: HybridAttentionConfig, model: ModelConfig):
        super().__init__()
        self.attention_config, self.model_config = attention, model
        std = attention.init_method_std
        self.word_embeddings = nn.Embedding(model.vocab_size, attention.hidden_size)
        nn.init.normal_(self.word_embeddings.weight, std=std)
        self.layers = nn.ModuleList(TransformerLayer(attention, model, layer_number=i + 1)
                                    for i in range(attention.num_layers))
        self.final_layernorm = RMSNorm(attention.hidden_size, attention.layernorm_epsilon)
        self.output_layer = (None if model.tie_embeddings
                             else linear(attention.hidden_size, model.vocab_size, std))

    def forward(self, tokens: Tensor) -> Tensor:
        self._check_tokens(tokens)
        hidden = self.word_embeddings(tokens.t())  # [S, B, d]
        for layer in self.layers:
            hidden = layer(hidden)
        hidden = self.final_layernorm(hidden).transpose(0, 1)  # [B, S, d]
        head = self.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        return F.linear(hidden, head).float()

    def indexer_losses(self) -> dict[int, float]:
        """`{layer_number: coefficient-scaled indexer KL}` of the last training forward (C layers only)."""
        losses = {}
        for layer in self.layers:
            attention = layer.self_attention
            if attention.last_indexer_loss is not None:
                losses[attention.layer_number] = float(attention.last_indexer_loss)
        return losses

    def _check_tokens(self, tokens: Tensor) -> None:
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be int64 [B, S], got {tokens.dtype} {tuple(tokens.shape)}")
        if tokens.shape[1] > self.model_config.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_seq_len "
                             f"{self.model_config.max_seq_len}")
