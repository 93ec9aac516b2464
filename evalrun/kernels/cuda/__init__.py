"""CUDA kernels: Triton (jitted on first use, kernels/cuda/jit.py) and flash-attn's paged attention."""
