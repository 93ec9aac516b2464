"""Torch references of every op (CPU and CUDA): what each fast kernel is checked against."""
