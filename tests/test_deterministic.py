"""Deterministic mode (`--deterministic`, issue 16 item 4): batch-invariant linears in every dtype.

A job's log-probabilities must be bitwise the same whether it runs alone or among 1, 8 or 64
others, in bfloat16 too: the references are the same job run alone (engine), F.linear (kernel,
to bf16 rounding) and an uninterrupted run at the default batch (CLI)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from evalrun.engine import Model
from evalrun.engine.auto import HostFacts, SettingError, choose_deterministic
from evalrun.commands.cli import main
from evalrun.kernels.cpu import gemm
from evalrun.kernels.linear import linear, make_linear
from engine_helpers import greedy_jobs, make_generator, random_prompts, run_jobs
from run_helpers import sigkill_after_parts

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"
needs_gemm = pytest.mark.skipif(not gemm.available(), reason="the native GEMM needs AVX2/FMA")

AVX2 = frozenset({"avx2", "fma"})
ZEN5 = AVX2 | {"avx512f", "avx512_bf16"}


def test_auto_choices_follow_dtype_and_cpu():
    assert choose_deterministic("auto", "cpu", "float32", HostFacts(ZEN5, False, None), None).value == "on"
    assert choose_deterministic("auto", "cpu", "bfloat16", HostFacts(AVX2, False, None), None).value == "on"
    off = choose_deterministic("auto", "cpu", "bfloat16", HostFacts(ZEN5, False, None), None)
    assert off.value == "off" and "avx512_bf16" in off.reason and "--deterministic on" in off.reason
    assert choose_deterministic("on", "cpu", "bfloat16", HostFacts(ZEN5, False, None), None).value == "on"
    assert choose_deterministic("off", "cpu", "float32", HostFacts(AVX2, False, None), None).value == "off"
    cuda = HostFacts(AVX2, True, "12.8", 1)
    auto = choose_deterministic("auto", "cuda", "bfloat16", cuda, None)
    assert auto.value == "off" and "not measured" in auto.reason
    assert choose_deterministic("on", "cuda", "bfloat16", cuda, None).value == "on"
    why = "batch-invariant CUDA linears need triton"
    assert choose_deterministic("auto", "cpu", "float32", HostFacts(AVX2, False, None), why).value == "off"
    with pytest.raises(SettingError, match="--deterministic on: batch-invariant CUDA linears need triton"):
        choose_deterministic("on", "cuda", "bfloat16", cuda, why)


@needs_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_invariant_linear_matches_f_linear_and_ignores_the_batch(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 96, generator=g).to(dtype)                 # N not a multiple of 16: a padded panel
    b = torch.randn(200, generator=g).to(dtype)
    x = torch.randn(64, 96, generator=g).to(dtype)
    res = torch.randn(64, 200, generator=g).to(dtype)
    lin = make_linear(w, b, invariant=True)
    assert lin.panels is not None and lin.packed is None
    y = linear(x, lin, residual=res)
    assert y.dtype == dtype
    # reference: the exact float32 products of the same values, rounded once, then the residual add
    ref = (F.linear(x.float(), w.float(), b.float()).to(dtype) + res) if dtype != torch.float32 \
        else F.linear(x, w, b) + res
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(y.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=0)
    for n in (1, 8, 64):                                            # a row alone and among others: same bits
        assert torch.equal(linear(x[:n], lin, residual=res[:n]), y[:n])
    assert torch.equal(linear(x[5:6], lin, residual=res[5:6]), y[5:6])


def test_invariant_linear_refuses_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(gemm, "unavailable_reason", lambda: "this CPU lacks AVX2 and FMA, which the native GEMM needs")
    with pytest.raises(ValueError, match="need the native GEMM: this CPU lacks AVX2"):
        make_linear(torch.zeros(16, 16, dtype=torch.bfloat16), invariant=True)
    with pytest.raises(ValueError, match="deterministic mode"):
        Model.load("unused", dtype="bfloat16", deterministic=True)


@needs_gemm
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_jobs_logits_do_not_depend_on_its_batch(tiny_model_dir, dtype, monkeypatch):
    """Job 0's prompt logits and greedy tokens alone, then among 1, 8 and 64 other jobs: bitwise equal.
    EVALRUN_LINEAR=torch asks for F.linear/MKL, whose float32 results at 1-2 rows differ from those
    at more rows on the development CPU (the same comparison without the mode moved the tiny
    model's logits by ~6e-6): the mode must not take it."""
    monkeypatch.setenv("EVALRUN_LINEAR", "torch")
    model = Model.load(tiny_model_dir, dtype=dtype, deterministic=True)
    mode = "bf16" if dtype == "bfloat16" else "fp32"
    prompts = random_prompts(65, [23, 40, 7, 61, 18], model.config.vocab_size, seed=3)
    runs = []
    for others in (0, 1, 8, 64):
        gen = make_generator(model, max_tokens=8192, page_size=16, mode=mode)
        out = run_jobs(gen, greedy_jobs(prompts[:1 + others], max_new_tokens=6, return_logits=True))
        runs.append(out[0])
    for r in runs[1:]:
        assert r["all_token_ids"] == runs[0]["all_token_ids"]
        assert torch.equal(r["all_logits"], runs[0]["all_logits"])


def _cli(*args: str) -> int:
    return main(["mmlu", "--no-progress", "--dtype", "bfloat16", "--cache-mode", "bf16", *args])


def _logprobs(out: Path) -> tuple[pd.DataFrame, np.ndarray]:
    df = pd.read_parquet(out / "samples.parquet").sort_values(["subject", "doc_id"]).reset_index(drop=True)
    return df, np.stack(list(df.choice_logprobs))


@needs_gemm
def test_bf16_mmlu_is_bitwise_the_same_at_any_batch_size_and_after_a_kill(tiny_model_dir, tmp_path):
    args = ["--model", str(tiny_model_dir), "--data-dir", str(FIXTURE), "--deterministic", "on",
            "--subjects", "abstract_algebra,high_school_biology,philosophy,nutrition", "--limit", "8"]
    runs = {}
    for bs in ("1", "8", None):
        out = tmp_path / f"bs{bs}"
        assert _cli(*args, "--output-dir", str(out), *(["--max-batch-size", bs] if bs else [])) == 0
        runs[bs] = _logprobs(out)
    base_df, base = runs[None]
    assert len(base_df) == 32
    for bs in ("1", "8"):
        assert list(runs[bs][0].prediction) == list(base_df.prediction)
        assert np.array_equal(runs[bs][1].view(np.uint32), base.view(np.uint32)), f"batch {bs} moved a log-prob"

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "evalrun", "mmlu", "--no-progress", "--dtype", "bfloat16", "--cache-mode",
           "bf16", *args, "--output-dir", str(out), "--flush-rows", "3", "--max-batch-size", "2"]
    sigkill_after_parts(cmd, out)
    assert _cli(*args, "--output-dir", str(out)) == 0                 # resumed at the default batch
    df, resumed = _logprobs(out)
    assert not df[["subject", "doc_id"]].duplicated().any() and len(df) == 32
    assert np.array_equal(resumed.view(np.uint32), base.view(np.uint32))


@needs_gemm
def test_the_setting_is_part_of_the_run_identity(tiny_model_dir, tmp_path, capsys):
    import json
    args = ["--model", str(tiny_model_dir), "--data-dir", str(FIXTURE), "--subjects", "nutrition", "--limit", "2"]
    out = tmp_path / "run"
    assert _cli(*args, "--output-dir", str(out), "--deterministic", "on") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["deterministic"] is True and manifest["deterministic"] is True
    bf16 = manifest["engine_choices"]["dtype"]["value"] == "bfloat16"       # auto: as this CPU measures
    assert manifest["kernels"]["linear"] == ("native-bf16" if bf16 else "native-gemm")
    assert manifest["cuda_graphs"] is False
    assert manifest["engine_choices"]["deterministic"]["value"] == "on"
    assert _cli(*args, "--output-dir", str(out), "--deterministic", "off") == 2
    assert "deterministic" in capsys.readouterr().err
    assert _cli(*args, "--output-dir", str(out)) == 0                 # auto resumes as stored
    off = tmp_path / "off"
    assert _cli(*args, "--output-dir", str(off), "--deterministic", "off") == 0
    manifest = json.loads((off / "manifest.json").read_text())
    assert "deterministic" not in manifest["identity"] and manifest["deterministic"] is False
    assert _cli(*args, "--output-dir", str(off)) == 0                 # a run without the key resumes as off
