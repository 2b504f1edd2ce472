"""Our own Triton kernels (one module per op). They run on any CUDA GPU Triton supports, and on CPU
under the Triton interpreter (`TRITON_INTERPRET=1`, used by the CPU tests).

Names pair the two halves of an op: `<op>.py` is the host side (input checks, autotuning, launch) and
launches the kernels of `_<op>_kernels.py` (sparse attention also has Hopper variants,
`_sparse_attention_hopper_forward_kernels.py` and `_sparse_attention_hopper_backward_kernels.py`).
`availability`, `lazy_jit` and `tiles` are the launchers' shared helpers."""
