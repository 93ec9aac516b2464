"""lm-eval's `--model evalrun` (evalrun/lm_eval_backend.py): lm-eval's own evaluator on our engine gives
lm-eval's HF backend's numbers (float32, same tiny model): per-document responses within 1e-4,
identical filtered responses and aggregate metrics; through simple_evaluate and through lm-eval's CLI
(`python -m evalrun.lm_eval_backend`); a bad model_args key is one line naming it."""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sacrebleu", reason="lm-eval's TaskManager imports sacrebleu: install evalrun[lm-eval]")

import evalrun.lm_eval_backend  # noqa: E402,F401 - registers "evalrun"
from evalrun.errors import BadInput  # noqa: E402
from evalrun.lm_eval_backend import main, request_seed  # noqa: E402
from lm_eval_fixtures import _kept_random_state, run_evalrun_backend, run_lm_eval_reference, write_fixture_tasks  # noqa: E402
from lm_eval_fixtures import REFERENCE_CASES, aggregate_close, close as _close  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MMLU_DIR = ROOT.parent / "shared" / "data" / "mmlu"


@pytest.fixture(autouse=True)
def _lm_eval_logging_restored():
    """lm-eval's CLI (setup_logging) binds a handler to the stderr pytest captures for that test and stops
    the "lm_eval" logger's propagation: undone after each test, so later tests' lm-eval warnings neither
    write to a closed stream nor bypass their capture."""
    import lm_eval.utils
    log = logging.getLogger("lm_eval")
    handlers, propagate, level = list(log.handlers), log.propagate, log.level
    configured = getattr(lm_eval.utils, "_LOGGING_CONFIGURED", None)
    yield
    log.handlers[:] = handlers
    log.propagate, log.level = propagate, level
    if configured is not None:
        lm_eval.utils._LOGGING_CONFIGURED = configured


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> Path:
    return write_fixture_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), MMLU_DIR if MMLU_DIR.is_dir() else None)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, include_path):
    """run_lm_eval_reference for one task, each computed once in the module."""
    done: dict[tuple[str, int], dict] = {}

    def get(task: str, shots: int) -> dict:
        if (task, shots) not in done:
            done[task, shots] = run_lm_eval_reference(tiny_model_dir, [task], include_path, num_fewshot=shots)
        return done[task, shots]
    return get


# NOTE: in the reverse of test_lm_eval_tasks.py's order: run beside it on another xdist worker, each file computes
# half of the lm-eval references and reads the other half back (tests/reference_cache.py).
@pytest.mark.parametrize("task,shots", REFERENCE_CASES[::-1])
def test_simple_evaluate_equals_lm_eval_hf(tiny_model_dir, include_path, reference, task, shots):
    if task.startswith("mmlu") and not MMLU_DIR.is_dir():
        pytest.skip(f"no MMLU data at {MMLU_DIR}")
    ref = reference(task, shots)
    ours = run_evalrun_backend(tiny_model_dir, [task], include_path, shots)
    mine = {(s["doc_id"], s["filter"]): s for s in ours["samples"][task]}
    assert len(mine) == len(ref["samples"][task])
    for s in ref["samples"][task]:
        o = mine[(s["doc_id"], s["filter"])]
        assert o["arguments"] == s["arguments"], f"{task} doc {s['doc_id']}: requests differ"
        assert _close(o["resps"], s["resps"]), f"{task} doc {s['doc_id']}: responses differ"
        assert _close(o["filtered_resps"], s["filtered_resps"]), f"{task} doc {s['doc_id']}: filtered differ"
        for m in s["metrics"]:
            assert _close(o[m], s[m]), f"{task} doc {s['doc_id']}: {m} differs"
    for key, want in ref["results"][task].items():
        if "," in key:
            assert aggregate_close(key, ours["results"][task][key], want), f"{task}: {key}"


def test_cli_writes_lm_eval_results_with_the_hf_numbers(tiny_model_dir, include_path, reference, tmp_path):
    ref = reference("arc_tiny", 2)["results"]["arc_tiny"]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "evalrun.lm_eval_backend", "--model", "evalrun", "--model_args",
                           f"pretrained={tiny_model_dir},dtype=float32", "--tasks", "arc_tiny", "--include_path",
                           str(include_path), "--num_fewshot", "2", "--output_path", str(out)],
                          cwd=ROOT, env={**os.environ, "USE_HUB_KERNELS": "0"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [results] = out.rglob("results_*.json")
    got = json.loads(results.read_text())["results"]["arc_tiny"]
    for key in ("acc,none", "acc_norm,none"):
        assert math.isclose(got[key], ref[key], abs_tol=1e-9), key


def test_bad_model_args_key_is_one_line_naming_it(tiny_model_dir, include_path, monkeypatch, capsys):
    from lm_eval import simple_evaluate
    with pytest.raises(BadInput, match="'colour'") as info, _kept_random_state():
        simple_evaluate(model="evalrun", model_args=f"pretrained={tiny_model_dir},colour=red", tasks=["arc_tiny"])
    assert "\n" not in str(info.value)
    monkeypatch.setattr(sys, "argv", ["lm-eval", "--model", "evalrun", "--model_args",
                                      f"pretrained={tiny_model_dir},colour=red", "--tasks", "arc_tiny",
                                      "--include_path", str(include_path)])
    assert main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "'colour'" in err[-1]


def test_a_call_asks_identical_requests_once_and_answers_in_order(tiny_model_dir):
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model
    lm = get_model("evalrun").create_from_arg_string(f"pretrained={tiny_model_dir},dtype=float32,batch_size=4")
    ctx = "Question: which gas do plants take in?\nAnswer:"
    pairs = [(ctx, " carbon dioxide"), (ctx, " oxygen"), (ctx, " carbon dioxide")]
    stats = lm.engine.generator.stats
    before = stats()["prompt_tokens"]
    out = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    asked = stats()["prompt_tokens"] - before
    alone = [lm.loglikelihood([Instance("loglikelihood", {}, p, 0)])[0] for p in pairs[:2]]
    assert stats()["prompt_tokens"] - before == 2 * asked           # the third request was no job ...
    assert out[2] == out[0] and _close(out, [alone[0], alone[1], alone[0]], 1e-5)     # ... and answers stay in order
    greedy = {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}
    sampled = {"until": ["\n"], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0}
    gen = [Instance("generate_until", {}, (ctx, kw), 0) for kw in (greedy, greedy, sampled, sampled)]
    texts = lm.generate_until(gen)
    assert texts[0] == texts[1] and texts[2] != texts[3]            # the repeats of a sampled request differ ...
    assert lm.generate_until(gen) == texts                          # ... the same under lm-eval's same torch seed


def test_request_seeds_differ_between_repeats():
    seeds = {request_seed(1234, i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**31 for s in seeds)
