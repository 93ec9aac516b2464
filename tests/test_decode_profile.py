"""benchmarks/decode_profile.py on the tiny model: the native step's stage timers add up to the step."""
from __future__ import annotations

import pytest

from engine import Model, Tokenizer
from kernels import decode_step, gemm

pytestmark = pytest.mark.skipif(not gemm.available() or decode_step._lib() is None,
                                reason="native kernels unavailable here")


def test_profile_accounts_for_the_step(tiny_model_dir):
    from benchmarks.decode_profile import profile_steps, LINEAR_STAGES
    model = Model.load(tiny_model_dir, dtype="float32")
    p = profile_steps(model, Tokenizer.load(tiny_model_dir), rows=3, steps=4)
    assert p["native_step"]
    assert set(decode_step.STAGES) <= set(p["ms"])
    assert all(p["ms"][s] > 0 for s in LINEAR_STAGES + ("attention", "lm_head (+ final norm)"))
    inside = sum(p["ms"][s] for s in decode_step.STAGES) + p["ms"]["lm_head (+ final norm)"]
    assert 0 < inside <= p["ms_per_step"]                     # timers inside the step, never beyond it
