"""Kernel backends and the dispatcher. Importing this package registers every backend module."""

# Importing a backend module registers it; vendor packages are imported only when probed.
from megatron_dsa.backends import (cudnn, flash_attn, flashmla, torch_scaled_mm, torch_sdpa, triton,  # noqa: F401
                                   unfused)
# The op families as torch.library custom ops, which `dispatch` calls inside a torch.compile trace.
from megatron_dsa.backends import library  # noqa: F401
from megatron_dsa.backends.registry import (
    AUTO,
    AUTO_ORDER,
    FAMILY_KEYS,
    Backend,
    BackendSelector,
    BackendUnavailableError,
    CallDescriptionError,
    OpFamily,
    Requested,
    auto_order,
    availability_table,
    call_counts,
    check_auto_order,
    check_backend_choice,
    dispatch,
    register_backend,
    registered_backends,
    reset_call_counts,
    resolve,
    set_auto_order,
    variant_counts,
)
from megatron_dsa.backends.triton_kernels.lazy_jit import chained_launches

check_auto_order()  # every built-in backend has its place in `AUTO_ORDER`, and only those that implement a family

__all__ = [
    "AUTO", "AUTO_ORDER", "FAMILY_KEYS", "Backend", "BackendSelector", "BackendUnavailableError",
    "CallDescriptionError", "OpFamily", "Requested", "auto_order", "availability_table", "call_counts",
    "chained_launches", "check_backend_choice", "dispatch", "register_backend", "registered_backends",
    "reset_call_counts", "resolve", "set_auto_order", "variant_counts",
]
