"""Kernel backends and the dispatcher. Importing this package registers every backend module."""

# Importing a backend module registers it; vendor packages are imported only when probed.
from megatron_dsa.backends import cudnn, flash_attn, flashmla, torch_sdpa, triton, unfused  # noqa: F401
# The op families as torch.library custom ops, which `dispatch` calls inside a torch.compile trace.
from megatron_dsa.backends import library  # noqa: F401
from megatron_dsa.backends.registry import (
    AUTO,
    Backend,
    BackendUnavailableError,
    BackendSelector,
    OpFamily,
    Requested,
    availability_table,
    call_counts,
    check_backend_choice,
    dispatch,
    register_backend,
    registered_backends,
    reset_call_counts,
    resolve,
)

__all__ = [
    "AUTO", "Backend", "BackendSelector", "BackendUnavailableError", "OpFamily", "Requested",
    "availability_table", "call_counts", "check_backend_choice", "dispatch", "register_backend",
    "registered_backends", "reset_call_counts", "resolve",
]
