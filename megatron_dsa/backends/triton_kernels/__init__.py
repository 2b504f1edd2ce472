"""Our own Triton kernels (one module per op). They run on any CUDA GPU Triton supports, and on CPU
under the Triton interpreter (`TRITON_INTERPRET=1`, used by the CPU tests)."""
