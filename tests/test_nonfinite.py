"""NaN / Inf logits (issue 13, item 6): a broken model must not run to exit 0 with every answer
'A'. The generator counts the sampled positions whose logits are not finite (and samples from
finite rows instead of crashing); `evalrun mmlu` stops naming the first affected question
(--on-nonfinite error, the default: exit 1, earlier rows kept) or records it as wrong and flagged
(--on-nonfinite flag)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings, Tokenizer
from evalrun.engine.verify import mark_nonfinite as _mark_nonfinite
from evalrun.commands.cli import main
from evalrun.results import read_samples
from evalrun.tasks.mmlu import build_prompt
from evalrun.tasks.mmlu_data import load_mmlu

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"
SUBJECT = "philosophy"


def _poisoned_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_mark_nonfinite_counts_rows_and_gives_the_sampler_finite_ones():
    jobs = [SimpleNamespace(state=SimpleNamespace(nonfinite_logits=0)) for _ in range(4)]   # stand-ins for jobs
    logits = torch.tensor([[1.0, 2.0, 3.0], [float("nan"), 5.0, 1.0], [0.0, float("inf"), 1.0],
                           [float("nan")] * 3])
    finite = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert _mark_nonfinite(jobs[:2], finite) is finite                      # nothing to do: untouched
    huge = torch.full((2, 3), 3e38)                                         # finite, but the sum overflows
    assert _mark_nonfinite(jobs[:2], huge) is huge and jobs[0].state.nonfinite_logits == 0
    out = _mark_nonfinite(jobs, logits)
    assert [j.state.nonfinite_logits for j in jobs] == [0, 1, 1, 1]
    assert torch.equal(out[0], logits[0])
    assert out[1].tolist() == [float("-inf"), 5.0, 1.0]                   # NaN never wins
    assert int(out[2].argmax()) == 1 and torch.isfinite(out[2]).all()      # +inf: the largest float
    assert out[3].tolist() == [0.0, 0.0, 0.0]                              # nothing left: uniform
    assert torch.isnan(logits[1, 0])                                       # the caller's tensor is kept


def test_generator_flags_jobs_from_a_nan_model_and_does_not_crash(tiny_model_dir, tmp_path):
    bad = _poisoned_copy(tiny_model_dir, tmp_path / "nan",
                         lambda w: w["model.norm.weight"].__setitem__(0, float("nan")))
    model, tok = Model.load(bad, dtype="float32"), Tokenizer.load(bad)
    good = Model.load(tiny_model_dir, dtype="float32")
    for m, expect in ((good, 0), (model, 5)):
        gen = DynamicGenerator(m, PagedCache(m, max_tokens=512, page_size=16), tok)
        jobs = [DynamicJob([1, 2, 3, 4], max_new_tokens=5, identifier="greedy"),
                DynamicJob([5, 6, 7], max_new_tokens=5, identifier="sampled", seed=3,
                           gen_settings=SamplerSettings(temperature=1.0, top_p=0.9)),
                DynamicJob([8, 9], max_new_tokens=5, identifier="logits", return_logits=True)]
        gen.enqueue(jobs)
        finals = {}
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r["eos"]:
                    finals[r["identifier"]] = r
        assert {k: r["nonfinite_logits"] for k, r in finals.items()} == {k: expect for k in finals}
        assert all(r["new_tokens"] == 5 for r in finals.values())
        if expect:
            assert torch.isnan(finals["logits"]["logits"]).all()          # returned as the model made them


def _question_token(tok: Tokenizer) -> tuple[int, int]:
    """(doc_id, token) of a philosophy question whose prompt has a token no other question's has."""
    data = load_mmlu(str(FIXTURE))
    prompts = {d.doc_id: set(tok.encode(build_prompt(SUBJECT, data.dev[SUBJECT], d))) for d in data.test[SUBJECT]}
    for doc_id in sorted(prompts)[2:]:
        others = set().union(*(p for i, p in prompts.items() if i != doc_id))
        only = sorted(prompts[doc_id] - others)
        if only:
            return doc_id, only[0]
    pytest.skip("no philosophy question of the fixture has a token of its own")


def _mmlu(model: Path, out: Path, *extra: str) -> int:
    return main(["mmlu", "--no-progress", "--model", str(model), "--data-dir", str(FIXTURE), "--subjects", SUBJECT,
                 "--dtype", "float32", "--cache-mode", "fp32", "--output-dir", str(out), *extra])


def test_mmlu_stops_on_nan_logits_naming_the_question_then_flag_records_it(tiny_model_dir, tmp_path, capsys):
    doc_id, token = _question_token(Tokenizer.load(tiny_model_dir))
    bad = _poisoned_copy(tiny_model_dir, tmp_path / "nan-row",
                         lambda w: w["model.embed_tokens.weight"][token].fill_(float("nan")))
    out = tmp_path / "run"

    assert _mmlu(bad, out) == 1                                            # default: --on-nonfinite error
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith("evalrun mmlu: error: ")      # one line, no traceback
    named = int(re.search(rf"subject={SUBJECT}, doc_id=(\d+)", err[0]).group(1))
    assert "--on-nonfinite flag" in err[0]
    kept = int(re.search(r"\((\d+) this session\)", err[0]).group(1))
    stored = {r["doc_id"] for r in read_samples(out).to_dict("records")}
    assert len(stored) == kept and named not in stored                      # earlier rows kept; not this one

    assert _mmlu(bad, out, "--on-nonfinite", "flag") == 0                    # resume: the rest, flagged
    rows = {r["doc_id"]: r for r in read_samples(out).to_dict("records")}
    assert sorted(rows) == list(range(8))
    flagged = sorted(i for i, r in rows.items() if r["nonfinite_logits"])
    # The poisoned question, and any question that reused its cached prefix pages: a masked (future)
    # NaN still turns earlier positions' attention into NaN (0 * NaN), and those K/V are shared.
    assert doc_id in flagged and named in flagged and not stored & set(flagged) and len(flagged) < 8
    assert f"warning: {len(flagged)} questions were scored from logits holding NaN or Inf" in capsys.readouterr().err
    assert all(rows[i]["prediction"] == "" and not rows[i]["correct"] for i in flagged)
    assert all(r["prediction"] and r["prediction"] in "ABCD" for i, r in rows.items() if i not in flagged)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nonfinite_logits"] == len(flagged)


def test_a_healthy_model_has_no_flags(tiny_model_dir, tmp_path):
    out = tmp_path / "ok"
    assert _mmlu(tiny_model_dir, out, "--limit", "3") == 0
    assert not read_samples(out)["nonfinite_logits"].any()
