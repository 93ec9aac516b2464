"""benchmarks/decode_profile.py on the tiny model: the native step's stage timers add up to the step."""
from __future__ import annotations

import pytest

from evalrun.engine import Model, Tokenizer
from evalrun.kernels.cpu import decode_step, gemm

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


def test_profile_blocks_pair_each_block_with_its_roof(tiny_model_dir):
    """--blocks: the steps are split over the blocks, each with its own roof, and the per-block
    shares are each block's linear GFLOP/s over that block's roof."""
    from benchmarks.decode_profile import profile_steps, block_shares
    model = Model.load(tiny_model_dir, dtype="float32")
    p = profile_steps(model, Tokenizer.load(tiny_model_dir), rows=2, steps=5, blocks=2, roof_n=64)
    assert [b["steps"] for b in p["blocks"]] == [2, 3]
    assert all(b["roof_gflops"] > 0 and b["linear_s"] > 0 and b["head_s"] > 0 for b in p["blocks"])
    work = {"body_flops_per_token": 1e6, "head_flops_per_token": 2e6}
    shares = block_shares(p["blocks"], 2, work)
    for b, s in zip(p["blocks"], shares):
        assert s["layers_gflops"] == pytest.approx(b["steps"] * 2 * 1e6 / b["linear_s"] / 1e9)
        assert s["all"] == pytest.approx(b["steps"] * 2 * 3e6 / (b["linear_s"] + b["head_s"]) / 1e9 / b["roof_gflops"])
    assert profile_steps(model, Tokenizer.load(tiny_model_dir), rows=2, steps=3)["blocks"] == []
