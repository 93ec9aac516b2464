"""`evalrun task`: lm-eval's YAML tasks on our engine give lm-eval 0.4.13's own numbers (HF backend,
float32, same tiny model): per-document log-likelihoods within 1e-4, identical predictions,
filtered responses and aggregate metrics (tests/lm_eval_fixtures.py writes the tasks and runs lm-eval)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sacrebleu", reason="lm-eval's TaskManager imports sacrebleu: install evalrun[lm-eval]")

from evalrun.commands.cli import main  # noqa: E402
from evalrun.results import read_samples  # noqa: E402
from lm_eval_fixtures import REFERENCE_CASES, aggregate_close, close as _close, run_lm_eval_reference, write_fixture_tasks  # noqa: E402

MMLU_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mmlu"


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> Path:
    return write_fixture_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), MMLU_DIR if MMLU_DIR.is_dir() else None)


def _ours(model: Path, tasks: str, include: Path, out: Path, *extra: str) -> list[dict]:
    rc = main(["task", "--tasks", tasks, "--include-path", str(include), "--model", str(model), "--dtype", "float32",
               "--output-dir", str(out), "--no-progress", *extra])
    assert rc == 0
    return read_samples(out).to_dict("records")



@pytest.mark.parametrize("task,shots", REFERENCE_CASES)
def test_task_equals_lm_eval(tiny_model_dir, include_path, tmp_path, task, shots):
    if task.startswith("mmlu") and not MMLU_DIR.is_dir():
        pytest.skip(f"no MMLU data at {MMLU_DIR}")
    ref = run_lm_eval_reference(tiny_model_dir, [task], include_path, num_fewshot=shots)
    rows = {r["doc_id"]: r for r in _ours(tiny_model_dir, task, include_path, tmp_path / "run",
                                          "--num-fewshot", str(shots), "--bootstrap-iters", "100000")}
    samples = ref["samples"][task]
    assert {s["doc_id"] for s in samples} == set(rows)
    for s in samples:
        row = rows[s["doc_id"]]
        resps = json.loads(row["resps"])
        assert _close(resps, s["resps"]), f"{task} doc {s['doc_id']}: responses differ"
        assert _close(json.loads(row["filtered_resps"])[s["filter"]], s["filtered_resps"])
        metrics = json.loads(row["metrics"])
        for m in s["metrics"]:
            assert _close(metrics[f"{m},{s['filter']}"], s[m]), f"{task} doc {s['doc_id']}: {m} differs"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    mine = summary["tasks"][task]
    for key, want in ref["results"][task].items():
        if "," in key:
            assert aggregate_close(key, mine[key], want), f"{task}: {key} {mine[key]} != {want}"


def test_mmlu_through_an_include_yaml_equals_evalrun_mmlu(tiny_model_dir, include_path, tmp_path):
    if not MMLU_DIR.is_dir():
        pytest.skip(f"no MMLU data at {MMLU_DIR}")
    ours = {r["doc_id"]: r for r in _ours(tiny_model_dir, "mmlu_local_anatomy", include_path, tmp_path / "t",
                                          "--num-fewshot", "5", "--limit", "12")}
    assert main(["mmlu", "--data-dir", str(MMLU_DIR), "--subjects", "anatomy", "--limit", "12", "--model",
                 str(tiny_model_dir), "--dtype", "float32", "--output-dir", str(tmp_path / "m"), "--no-progress"]) == 0
    mmlu = {r["doc_id"]: r for r in read_samples(tmp_path / "m").to_dict("records")}
    assert len(ours) == len(mmlu) == 12
    for doc_id, r in mmlu.items():
        lls = [ll for ll, _ in (resp[0] for resp in json.loads(ours[doc_id]["resps"]))]
        assert max(range(4), key=lambda i: (lls[i], -i)) == "ABCD".index(r["prediction"])
        assert max(abs(a - b) for a, b in zip(lls, r["choice_logprobs"])) < 1e-4


def test_bad_input_is_one_line_exit_2(tiny_model_dir, include_path, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "t.yaml").write_text("task: bad_files\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                f"    test: {tmp_path}/missing.jsonl\ntest_split: test\noutput_type: multiple_choice\n"
                                "doc_to_text: q\ndoc_to_target: 0\ndoc_to_choice: [a, b]\n")
    (bad / "u.yaml").write_text("task: bad_type\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                f"    test: {tmp_path}/missing.jsonl\ntest_split: test\noutput_type: ranking\n")
    for tasks, inc, words in [("no_such_task", include_path, "unknown task 'no_such_task'"),
                              ("bad_files", bad, "bad_files"), ("bad_type", bad, "output_type")]:
        rc = main(["task", "--tasks", tasks, "--include-path", str(inc), "--model", str(tiny_model_dir),
                   "--output-dir", str(tmp_path / tasks), "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2 and words in err, err


def test_killed_run_resumes_to_the_same_rows_and_a_changed_yaml_is_refused(tiny_model_dir, include_path, tmp_path,
                                                                           capsys):
    """A run killed mid-way (SIGKILL after its first rows) and resumed, and a run at --limit 6 extended
    to every document, give the rows of one uninterrupted run: each document keeps its few-shot
    examples (lm-eval's seeded sampler is replayed in document order). A changed YAML is another
    task: refused unless --overwrite."""
    import sys
    from run_helpers import assert_same_rows, sigkill_after_parts
    args = ["--tasks", "arc_tiny,gsm8k_tiny", "--include-path", str(include_path), "--model", str(tiny_model_dir),
            "--dtype", "float32", "--num-fewshot", "2", "--no-progress", "--flush-rows", "1"]
    _ours(tiny_model_dir, "arc_tiny,gsm8k_tiny", include_path, tmp_path / "whole", "--num-fewshot", "2")
    killed = tmp_path / "killed"
    sigkill_after_parts([sys.executable, "-m", "evalrun", "task", *args, "--output-dir", str(killed)], killed, parts=3)
    assert main(["task", *args, "--output-dir", str(killed)]) == 0
    assert_same_rows(killed, tmp_path / "whole", ["task_name", "doc_id"])
    grown = tmp_path / "grown"
    assert main(["task", *args, "--limit", "6", "--output-dir", str(grown)]) == 0
    assert main(["task", *args, "--output-dir", str(grown)]) == 0
    assert_same_rows(grown, tmp_path / "whole", ["task_name", "doc_id"])
    yaml = include_path / "arc_tiny" / "arc_tiny.yaml"
    original = yaml.read_text()
    try:
        yaml.write_text(original.replace("Answer:", "A:"))
        capsys.readouterr()
        assert main(["task", *args, "--output-dir", str(grown)]) == 2
        assert "--overwrite" in capsys.readouterr().err
    finally:
        yaml.write_text(original)
    hooks = ["--tasks", "hellaswag_tiny", *args[2:]]
    assert main(["task", *hooks, "--limit", "2", "--output-dir", str(tmp_path / "hooks")]) == 0
    utils = include_path / "hellaswag_tiny" / "utils.py"
    source = utils.read_text()
    try:                                    # a !function hook's source is part of the task's identity
        utils.write_text(source.replace("def preprocess(text):", "def preprocess(text):  # changed"))
        capsys.readouterr()
        assert main(["task", *hooks, "--limit", "2", "--output-dir", str(tmp_path / "hooks")]) == 2
        assert "--overwrite" in capsys.readouterr().err
    finally:
        utils.write_text(source)


def test_a_task_whose_documents_all_exceed_the_context_exits_2(tiny_model_dir, include_path, tmp_path, capsys):
    """A generation budget as long as the context leaves no room for any prompt: every document is
    a skipped row naming why, and the run exits 2 (there is no score)."""
    src = (include_path / "gsm8k_tiny" / "gsm8k_tiny.yaml").read_text()
    bad = tmp_path / "long"
    bad.mkdir()
    (bad / "g.yaml").write_text(src.replace("task: gsm8k_tiny", "task: gsm8k_long")
                                .replace("max_gen_toks: 32", "max_gen_toks: 4096"))
    rc = main(["task", "--tasks", "gsm8k_long", "--include-path", str(bad), "--model", str(tiny_model_dir),
               "--output-dir", str(tmp_path / "run"), "--no-progress", "--limit", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "all 3 documents were skipped" in err and "max_gen_toks (4096)" in err, err


def test_shards_merge_compare_and_a_suite(tiny_model_dir, include_path, tmp_path, capsys):
    """`--shard k/2` runs merge into the rows of one run (each document keeps its few-shot examples in
    any shard); `compare` reads two runs per task; a suite lists an lm-eval task."""
    from run_helpers import assert_same_rows
    common = ["--tasks", "arc_tiny,hellaswag_tiny", "--include-path", str(include_path), "--model", str(tiny_model_dir),
              "--dtype", "float32", "--num-fewshot", "2", "--no-progress"]
    assert main(["task", *common, "--output-dir", str(tmp_path / "whole")]) == 0
    for k in (0, 1):
        assert main(["task", *common, "--shard", f"{k}/2", "--output-dir", str(tmp_path / f"s{k}")]) == 0
    assert main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--output-dir", str(tmp_path / "m")]) == 0
    assert_same_rows(tmp_path / "m", tmp_path / "whole", ["task_name", "doc_id"])
    assert main(["task", *common, "--dtype", "bfloat16", "--output-dir", str(tmp_path / "bf16")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "whole"), str(tmp_path / "bf16"), "--format", "csv"]) == 0
    table = capsys.readouterr().out
    assert "arc_tiny" in table and "hellaswag_tiny" in table
    suite = tmp_path / "suite.toml"
    suite.write_text(f'output_dir = "{tmp_path / "nightly"}"\n[[tasks]]\nname = "task"\ntasks = "arc_tiny"\n'
                     f'include_path = "{include_path}"\nlimit = 4\n[[models]]\nname = "tiny"\npath = "{tiny_model_dir}"\n'
                     'cache_modes = ["fp32"]\ndtype = "float32"\n')
    assert main(["suite", str(suite), "--no-progress"]) == 0
    rows = read_samples(tmp_path / "nightly" / "task" / "tiny" / "fp32")
    assert len(rows) == 4 and set(rows["task_name"]) == {"arc_tiny"}


def test_a_group_is_aggregated_as_lm_eval_aggregates_it(tiny_model_dir, include_path, tmp_path):
    """`--tasks tiny_suite` (a group with aggregate_metric_list, weighted by size) runs its tasks and
    reports the group's acc and pooled stderr as lm-eval does."""
    ref = run_lm_eval_reference(tiny_model_dir, ["tiny_suite"], include_path, num_fewshot=2)
    _ours(tiny_model_dir, "tiny_suite", include_path, tmp_path / "run", "--num-fewshot", "2")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert set(summary["tasks"]) == {"arc_tiny", "hellaswag_tiny"}
    mine = summary["groups"]["tiny_suite"]
    keys = [k for k in ref["results"]["tiny_suite"] if "," in k]
    assert keys and all(_close(mine[k], ref["results"]["tiny_suite"][k], 1e-6) for k in keys), (mine, ref["results"])


@pytest.mark.parametrize("iters", [0, 1000])
def test_bootstrap_iters_reach_the_stderrs(tiny_model_dir, include_path, tmp_path, iters):
    """--bootstrap-iters as lm-eval's: 0 leaves every stderr "N/A"; 1000 bootstraps perplexity's stderr as
    lm-eval does with 1000 (not with its default 100000)."""
    ref = run_lm_eval_reference(tiny_model_dir, ["lambada_tiny"], include_path, bootstrap_iters=iters)
    _ours(tiny_model_dir, "lambada_tiny", include_path, tmp_path / "run", "--bootstrap-iters", str(iters))
    mine = json.loads((tmp_path / "run" / "summary.json").read_text())["tasks"]["lambada_tiny"]
    want = ref["results"]["lambada_tiny"]
    stderrs = [k for k in want if "_stderr," in k]
    assert stderrs and all(aggregate_close(k, mine[k], want[k]) for k in stderrs), (mine, want)
    if iters == 0:
        assert all(mine[k] == "N/A" for k in stderrs)
    else:
        default = run_lm_eval_reference(tiny_model_dir, ["lambada_tiny"], include_path)["results"]["lambada_tiny"]
        assert mine["perplexity_stderr,none"] != default["perplexity_stderr,none"]


def test_merged_shards_summarize_as_the_whole_run(tiny_model_dir, include_path, tmp_path):
    """`evalrun merge` of `--shard k/2` runs writes the whole run's summary: the group's lm-eval aggregate
    and the stderrs at the run's --bootstrap-iters (lambada's perplexity is bootstrapped)."""
    common = ["--num-fewshot", "2", "--bootstrap-iters", "1000"]
    _ours(tiny_model_dir, "tiny_suite,lambada_tiny", include_path, tmp_path / "whole", *common)
    for k in (0, 1):
        _ours(tiny_model_dir, "tiny_suite,lambada_tiny", include_path, tmp_path / f"s{k}", *common, "--shard", f"{k}/2")
    assert main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--output-dir", str(tmp_path / "m")]) == 0
    whole, merged = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "m"))
    assert set(whole["groups"]) == {"tiny_suite"} and set(whole["tasks"]) == {"arc_tiny", "hellaswag_tiny", "lambada_tiny"}
    assert merged["groups"] == whole["groups"] and merged["tasks"] == whole["tasks"]
    shard = json.loads((tmp_path / "s0" / "summary.json").read_text())
    assert shard["tasks"]["lambada_tiny"] != whole["tasks"]["lambada_tiny"]      # a shard's own is not the whole's
