"""nn.Modules of the package."""

from megatron_dsa.layers.cuda_graphs import GraphedLayer, make_graphed_layers
from megatron_dsa.layers.hybrid_attention import DenseMLAttention, HybridAttention

__all__ = ["DenseMLAttention", "GraphedLayer", "HybridAttention", "make_graphed_layers"]
