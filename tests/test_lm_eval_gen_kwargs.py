"""`evalrun task --gen-kwargs` (lm-eval's --gen_kwargs): laid over each generate_until task's generation_kwargs
as lm-eval's simple_evaluate lays them, so the requests, generations and metrics equal lm-eval's HF backend run
with the same --gen_kwargs (float32, same tiny model); the override is part of the run's identity; keys the
engine would not honour, and bad words, are one line before the model loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sacrebleu", reason="lm-eval's TaskManager imports sacrebleu: install evalrun[lm-eval]")

from evalrun.commands.cli import main  # noqa: E402
from evalrun.results import read_samples  # noqa: E402
from evalrun.tasks.lm_eval_requests import unsupported_gen_kwarg  # noqa: E402
from evalrun.tasks.lm_eval_spec import parse_gen_kwargs  # noqa: E402
from lm_eval_fixtures import close as _close, run_lm_eval_reference, write_fixture_tasks  # noqa: E402


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> Path:
    return write_fixture_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), None)


def _run(model: Path, include: Path, out: Path, *extra: str) -> int:
    return main(["task", "--tasks", "gsm8k_tiny", "--include-path", str(include), "--model", str(model), "--dtype",
                 "float32", "--num-fewshot", "1", "--output-dir", str(out), "--no-progress", *extra])


@pytest.mark.parametrize("words", [("max_gen_toks=6",), ('until=["\\n", "."]', "max_gen_toks=20"),
                                   ('{"max_new_tokens": 9, "do_sample": false}',)])
def test_gen_kwargs_equal_lm_eval_hf(tiny_model_dir, include_path, tmp_path, words):
    overrides = parse_gen_kwargs(words)
    ref = run_lm_eval_reference(tiny_model_dir, ["gsm8k_tiny"], include_path, num_fewshot=1,
                                gen_kwargs=overrides)["samples"]["gsm8k_tiny"]
    for s in ref:                                   # lm-eval laid them over the YAML's
        assert all(s["arguments"][0][1][k] == v for k, v in overrides.items())
    assert _run(tiny_model_dir, include_path, tmp_path / "t", "--gen-kwargs", *words) == 0
    rows = {r["doc_id"]: r for r in read_samples(tmp_path / "t").to_dict("records")}
    assert {s["doc_id"] for s in ref} == set(rows)
    for s in ref:
        row = rows[s["doc_id"]]
        assert json.loads(row["resps"]) == s["resps"], f"doc {s['doc_id']}: generations differ"
        assert json.loads(row["filtered_resps"])[s["filter"]] == s["filtered_resps"]
        metrics = json.loads(row["metrics"])
        for m in s["metrics"]:
            assert _close(metrics[f"{m},{s['filter']}"], s[m])
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["lm_eval"]["gen_kwargs"] == overrides


def test_the_override_shortens_the_generations(tiny_model_dir, include_path, tmp_path):
    """The same run without --gen-kwargs (the YAML's max_gen_toks) generates more than max_gen_toks=3 lets it."""
    assert _run(tiny_model_dir, include_path, tmp_path / "yaml") == 0
    assert _run(tiny_model_dir, include_path, tmp_path / "short", "--gen-kwargs", "max_gen_toks=3") == 0
    texts = {name: [json.loads(r)[0][0] for r in read_samples(tmp_path / name)["resps"]] for name in ("yaml", "short")}
    assert sum(map(len, texts["short"])) < sum(map(len, texts["yaml"]))
    for short, full in zip(texts["short"], texts["yaml"]):
        assert full.startswith(short)               # greedy: the shorter budget's text is the longer's start


def test_a_changed_override_is_another_identity(tiny_model_dir, include_path, tmp_path, capsys):
    out = tmp_path / "t"
    assert _run(tiny_model_dir, include_path, out, "--gen-kwargs", "max_gen_toks=4") == 0
    assert _run(tiny_model_dir, include_path, out, "--gen-kwargs", "max_gen_toks=4") == 0     # resumes: nothing left
    capsys.readouterr()
    assert _run(tiny_model_dir, include_path, out, "--gen-kwargs", "max_gen_toks=5") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "error: " in err[-1] and "holds another run" in err[-1]
    assert _run(tiny_model_dir, include_path, out, "--gen-kwargs", "max_gen_toks=5", "--overwrite") == 0


@pytest.mark.parametrize("words,needle", [(("num_beams=4",), "num_beams=4"),
                                          (("repetition_penalty=1.1",), "repetition_penalty"),
                                          (("max_gen_toks",), "key=value"),
                                          (('{"max_gen_toks": 4',), "JSON")])
def test_bad_gen_kwargs_are_one_line_before_the_model_loads(include_path, tmp_path, capsys, words, needle):
    missing = tmp_path / "no-model"                 # never opened: the refusal comes first
    assert _run(missing, include_path, tmp_path / "t", "--gen-kwargs", *words) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "error: " in err[-1] and needle in err[-1], err


def test_a_yaml_key_the_engine_would_ignore_is_refused(tiny_model_dir, tmp_path, capsys):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"q": "2 + 2 =", "a": "4"}) + "\n")
    (tasks / "beams.yaml").write_text(
        f"task: beams\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  num_beams: 3\nmetric_list:\n  - metric: exact_match\n")
    rc = main(["task", "--tasks", "beams", "--include-path", str(tasks), "--model", str(tiny_model_dir),
               "--output-dir", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "error: " in err[-1] and "task beams" in err[-1] and "num_beams=3" in err[-1]


def test_unsupported_gen_kwarg():
    assert unsupported_gen_kwarg({"until": ["\n"], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                  "top_k": 20, "min_p": 0.0, "max_new_tokens": 9, "num_beams": 1}) is None
    assert unsupported_gen_kwarg({"num_beams": 2}) == "num_beams=2"
    assert unsupported_gen_kwarg({"top_p": 0.9, "typical_p": 0.5}) == "typical_p=0.5"
