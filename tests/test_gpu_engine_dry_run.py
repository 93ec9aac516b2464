"""benchmarks/gpu_engine.py (the engine-level GPU figures of issue 16) in its --dry-run form on the CPU:
the script a lent GPU will run must not have rotted. A tiny float32 model: the baseline (transformers,
or the plain-torch DenseLlama) and our engine agree on every scored argmax and greedy token, and
deterministic mode's job alone equals it among the others."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_engine_dry_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_engine.py", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_engine.json").read_text())
    for name in ("default", "deterministic"):
        scored = out[f"mmlu_ours_{name}"]
        assert scored["same_argmax"] == scored["of"] and scored["max_abs_dlogprob_at_baseline_argmax"] < 1e-4
        assert out[f"decode_ours_{name}_eager"]["prompts_token_identical_to_baseline"] == "3/3"
    assert out["deterministic_alone_equals_batched"] is True
    assert {"deterministic_cost_mmlu", "deterministic_cost_decode", "baseline"} <= set(out)


def test_dense_llama_matches_transformers(tmp_path):
    """The fallback baseline is HF Llama's maths: same last-position logits and greedy tokens."""
    import pytest
    import torch
    pytest.importorskip("transformers")
    from benchmarks import gpu_engine
    model_dir = gpu_engine.make_model_dir(tmp_path / "m", gpu_engine.SHAPES["tiny"], torch.float32, torch.device("cpu"))
    mmlu, decode = gpu_engine.workloads(gpu_engine.SHAPES["tiny"]["vocab_size"], dry=True)
    hf = gpu_engine.Baseline(model_dir, torch.float32, torch.device("cpu"))
    dense = gpu_engine.Baseline(model_dir, torch.float32, torch.device("cpu"))
    dense.hf, dense.dense = None, gpu_engine.DenseLlama(model_dir, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(dense.last_logits(mmlu), hf.last_logits(mmlu), atol=1e-5, rtol=0)
    assert dense.greedy(decode, 5) == hf.greedy(decode, 5)
