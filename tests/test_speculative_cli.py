"""`--ngram-draft`, `--draft-model`, `--num-draft-tokens` on `evalrun humaneval` (issue 14)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from evalrun.commands.cli import main


def he(*args: str) -> int:
    return main(["humaneval", "--no-progress", *args])


@pytest.mark.parametrize("flags", [["--ngram-draft"], ["--draft-model", "SELF", "--num-draft-tokens", "3"]],
                         ids=["ngram", "draft-model"])
def test_speculative_flags_keep_greedy_completions_and_are_recorded(tmp_path, tiny_model_dir, flags, monkeypatch):
    """`--ngram-draft` / `--draft-model DIR`: the generator drafts that way, the completions are those
    without drafting (greedy is exact), the settings are in the manifest, the draft counts in the
    summary's generator stats."""
    from evalrun.engine import DynamicGenerator
    made = []
    real_init = DynamicGenerator.__init__
    monkeypatch.setattr(DynamicGenerator, "__init__", lambda self, *a, **k: made.append(k) or real_init(self, *a, **k))
    flags = [str(tiny_model_dir) if f == "SELF" else f for f in flags]
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--cache-mode", "fp32", "--limit", "4",
              "--max-new-tokens", "24", "--page-size", "16", "--workers", "1"]
    assert he(*common, "--output-dir", str(tmp_path / "plain")) == 0
    assert he(*common, *flags, "--output-dir", str(tmp_path / "spec")) == 0
    plain = pd.read_parquet(tmp_path / "plain" / "samples.parquet").sort_values("task_id")
    spec = pd.read_parquet(tmp_path / "spec" / "samples.parquet").sort_values("task_id")
    assert list(spec.completion) == list(plain.completion) and list(spec.new_tokens) == list(plain.new_tokens)
    manifest = json.loads((tmp_path / "spec" / "manifest.json").read_text())
    want = "ngram" if "--ngram-draft" in flags else "model"
    assert manifest["speculative"]["drafts"] == want and manifest["speculative"]["num_draft_tokens"] >= 3
    assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["speculative"] == {"drafts": None}
    summary = json.loads((tmp_path / "spec" / "summary.json").read_text())
    assert {"drafted_tokens", "accepted_draft_tokens"} <= set(summary["this_session"]["generator"])
    plain_kw, spec_kw = made
    assert not plain_kw["use_ngram_draft"] and plain_kw["draft_model"] is None
    if want == "ngram":
        assert spec_kw["use_ngram_draft"] and spec_kw["num_draft_tokens"] == 4
    else:
        assert spec_kw["draft_model"] is not None and spec_kw["draft_cache"] is not None
        assert spec_kw["num_draft_tokens"] == 3


def test_speculative_flags_are_checked_before_loading(tmp_path, tiny_model_dir, capsys):
    base = ["--model", str(tiny_model_dir), "--limit", "1", "--output-dir", str(tmp_path / "x")]
    assert he(*base, "--num-draft-tokens", "0") == 2
    assert "--num-draft-tokens must be >= 1" in capsys.readouterr().err
    assert he(*base, "--draft-model", str(tmp_path / "missing")) == 2
    assert "model directory not found" in capsys.readouterr().err
