"""Attention, cache and linear kernels: torch references and native / GPU versions."""
import os as _os

# The native kernels run on their own thread pool (csrc/pool.c). By default libgomp's workers, which
# torch's small ops between those kernels wake, spin for a long while after each op (GOMP_SPINCOUNT
# 300000) and take the cores the pool needs: a short spin made decode steps 20-35% faster on the
# 2-core development machine (FIELD_NOTES). libgomp reads this once, when torch loads it, so every
# evalrun package imports this one before torch; a setting of the user's (either variable) wins.
SET_ENV: dict[str, str] = {}          # what this import set (benchmarks take it away from peer processes)
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = SET_ENV["GOMP_SPINCOUNT"] = "10000"

from . import malloc_tuning as _malloc_tuning  # noqa: E402  (freed activations stay mapped: see the module)

_malloc_tuning.apply()
