"""Attention, cache and linear kernels: torch references and native / GPU versions.

The process settings these kernels want (libgomp's spin, glibc malloc thresholds) are applied by
`import evalrun` (evalrun/process.py), which runs before this package is imported.
"""
