"""nn.Modules of the package."""

from megatron_dsa.layers.hybrid_attention import DenseMLAttention, HybridAttention

__all__ = ["DenseMLAttention", "HybridAttention"]
