"""Temporary re-export for evalrun/engine/sampler.py and verify.py, which import `fused` from here:
the per-row logits passes now live in kernels/cpu/fused.py. Delete once they import that."""
from __future__ import annotations

from .cpu.fused import argmax_finite_rows, argmax_rows, finite_rows

__all__ = ["argmax_finite_rows", "argmax_rows", "finite_rows"]
