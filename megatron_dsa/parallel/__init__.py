"""Process groups, autograd collectives and tensor-parallel linears (no Megatron-Core dependency)."""

from megatron_dsa.parallel.linear import ColumnParallelLinear, RowParallelLinear
from megatron_dsa.parallel.state import ParallelState, initialize_parallel_state

__all__ = ["ColumnParallelLinear", "ParallelState", "RowParallelLinear", "initialize_parallel_state"]
