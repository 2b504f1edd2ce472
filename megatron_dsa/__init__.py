"""megatron_dsa: DeepSeek-V4-style hybrid attention (CSA / HCA / sliding window / dense MLA) for
Megatron-style training stacks, with an unfused PyTorch reference path that runs everywhere."""

from megatron_dsa.config import HybridAttentionConfig, LayerKind
from megatron_dsa.layers import DenseMLAttention, GraphedLayer, HybridAttention, make_graphed_layers

__version__ = "0.1.0"

__all__ = ["DenseMLAttention", "GraphedLayer", "HybridAttention", "HybridAttentionConfig", "LayerKind",
           "__version__", "make_graphed_layers"]
