"""Pure-function reference ops of the hybrid attention layer (also the CPU fallback)."""
