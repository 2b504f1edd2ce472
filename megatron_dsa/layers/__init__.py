"""nn.Modules of the package."""

from megatron_dsa.layers.cuda_graphs import GraphedLayer, make_graphed_layers
from megatron_dsa.layers.decode_graph import DecodeGraph
from megatron_dsa.layers.hybrid_attention import DenseMLAttention, HybridAttention
from megatron_dsa.layers.kinds import KINDS, KindSpec, build_attention, register_kind

__all__ = ["DecodeGraph", "DenseMLAttention", "GraphedLayer", "HybridAttention", "KINDS", "KindSpec", "build_attention",
           "register_kind",
           "make_graphed_layers"]
