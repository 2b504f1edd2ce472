"""megatron_dsa: DeepSeek-V4-style hybrid attention (CSA / HCA / sliding window / dense MLA) for
Megatron-style training stacks, with an unfused PyTorch reference path that runs everywhere."""

from megatron_dsa.config import HybridAttentionConfig, LayerKind
from megatron_dsa.layers import DenseMLAttention, HybridAttention

__version__ = "0.1.0"

__all__ = ["DenseMLAttention", "HybridAttention", "HybridAttentionConfig", "LayerKind", "__version__"]
