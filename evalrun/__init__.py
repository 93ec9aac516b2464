"""evalrun: offline LLM evaluation on a paged-KV dynamic generator.

Subpackages: evalrun.engine (generator), evalrun.tasks (task adapters, sandbox), evalrun.kernels
(torch references, native CPU and GPU kernels), evalrun.results (run store, comparisons).
"""
from .process import apply_process_settings

# NOTE: before anything imports torch: libgomp reads its spin setting when torch loads it (process.py)
apply_process_settings()

__version__ = "0.1.0"
