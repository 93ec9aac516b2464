"""Chat templates on the tasks (evalrun/tasks/chat.py): `evalrun mmlu` and `evalrun task` with
--apply-chat-template ask lm-eval 0.4.13's own chat prompts (`--apply_chat_template
--fewshot_as_multiturn`, HF backend, float32), character for character, and give its predictions;
the template's identity is part of the run's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sacrebleu", reason="lm-eval's TaskManager imports sacrebleu: install evalrun[lm-eval]")

from evalrun.commands.cli import main  # noqa: E402
from evalrun.results import read_prompts, read_samples  # noqa: E402
from evalrun.tasks.chat import ChatOptions, Turn, chat_messages, maybe_delimit, qa_turns  # noqa: E402
from lm_eval_fixtures import QWEN_LIKE, close as _close, run_lm_eval_reference, write_fixture_tasks  # noqa: E402

MMLU_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mmlu"
CHAT = {"apply_chat_template": True, "fewshot_as_multiturn": True}
SYSTEM = "Answer with the letter only."


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> Path:
    return write_fixture_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), MMLU_DIR if MMLU_DIR.is_dir() else None)


def _run(*argv: str) -> None:
    assert main([*argv, "--dtype", "float32", "--no-progress"]) == 0


def _rows_and_prompts(out: Path) -> tuple[dict, dict]:
    return {r["doc_id"]: r for r in read_samples(out).to_dict("records")}, read_prompts(out)


def _reference_prompts(samples: list[dict]) -> dict[int, str]:
    prompts = {}
    for s in samples:
        contexts = {arg[0] for arg in s["arguments"]}
        assert len(contexts) == 1, "one context per document"
        prompts[s["doc_id"]] = contexts.pop()
    return prompts


# -- lm-eval's message building, mirrored -------------------------------------------------------------------------

def test_turns_follow_lm_eval_message_building():
    from lm_eval.api.utils import Message, maybe_delimit as lm_maybe_delimit, multiturn_to_singleturn
    for a, b in [("x", "y"), ("x ", "y"), ("x", "\ny"), ("", "y"), ("x", ""), (None, "y")]:
        assert maybe_delimit(a, b, "\n\n") == lm_maybe_delimit(a, b, "\n\n")
    turns = qa_turns("About cats.\n\n", [("Q1?", "A"), ("Q2?", "B")], "Q3?", SYSTEM)
    assert turns[0] == Turn("system", SYSTEM + "\n\nAbout cats.\n\n")
    theirs = [Message(t.role, t.content, t.delimiter) for t in turns]
    assert chat_messages(turns, multiturn=True) == [m.to_dict() for m in theirs]
    assert chat_messages(turns, multiturn=False) == multiturn_to_singleturn(theirs)
    with_prefix = turns + [Turn("assistant", "Answer:")]
    theirs = [Message(t.role, t.content, t.delimiter) for t in with_prefix]
    assert chat_messages(with_prefix, multiturn=False) == multiturn_to_singleturn(theirs)


# -- evalrun mmlu ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,ref", [((), CHAT),
                                      (("--no-fewshot-as-multiturn", "--system-instruction", SYSTEM),
                                       {"apply_chat_template": True, "fewshot_as_multiturn": False,
                                        "system_instruction": SYSTEM})])
def test_mmlu_chat_prompts_and_predictions_equal_lm_eval(tiny_model_dir, include_path, tmp_path, extra, ref):
    if not MMLU_DIR.is_dir():
        pytest.skip(f"no MMLU data at {MMLU_DIR}")
    subject = "abstract_algebra"
    want = run_lm_eval_reference(tiny_model_dir, [f"mmlu_local_{subject}"], include_path, num_fewshot=5, limit=20,
                                 **ref)["samples"][f"mmlu_local_{subject}"]
    _run("mmlu", "--data-dir", str(MMLU_DIR), "--subjects", subject, "--limit", "20", "--model", str(tiny_model_dir),
         "--output-dir", str(tmp_path / "m"), "--apply-chat-template", *extra)
    rows, prompts = _rows_and_prompts(tmp_path / "m")
    assert len(rows) == len(want) == 20
    for doc_id, context in _reference_prompts(want).items():
        assert prompts[rows[doc_id]["prompt_hash"]] == context, f"doc {doc_id}: the prompt differs"
    for s in want:
        lls = [resp[0][0] for resp in s["resps"]]
        row = rows[s["doc_id"]]
        assert _close(list(row["choice_logprobs"]), lls), f"doc {s['doc_id']}: log-likelihoods differ"
        assert row["prediction"] == "ABCD"[max(range(4), key=lambda i: (lls[i], -i))]


def test_mmlu_chat_identity_refuses_a_plain_resume_and_a_changed_template(tiny_model_dir, tmp_path, capsys):
    if not MMLU_DIR.is_dir():
        pytest.skip(f"no MMLU data at {MMLU_DIR}")
    out = tmp_path / "m"
    base = ["mmlu", "--data-dir", str(MMLU_DIR), "--subjects", "anatomy", "--limit", "2", "--model",
            str(tiny_model_dir), "--output-dir", str(out), "--dtype", "float32", "--no-progress"]
    assert main(base + ["--apply-chat-template"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    chat = manifest["identity"]["chat"]
    assert chat["template"] == "default" and chat["fewshot_as_multiturn"] is True and len(chat["template_sha256"]) == 64
    capsys.readouterr()
    assert main(base) == 2                                     # the plain prompts are another run
    assert main(base + ["--apply-chat-template", "--no-fewshot-as-multiturn"]) == 2


def test_chat_flags_without_a_template_are_refused(tiny_model_dir, tmp_path, capsys):
    for flags in (["--fewshot-as-multiturn"], ["--enable-thinking"],
                  ["--apply-chat-template", "--enable-thinking", "--disable-thinking"],
                  ["--apply-chat-template", "no-such-template"]):
        rc = main(["mmlu", "--data-dir", str(MMLU_DIR), "--limit", "1", "--subjects", "anatomy", "--model",
                   str(tiny_model_dir), "--output-dir", str(tmp_path / "x"), "--no-progress", *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, (flags, err)


def test_chat_options_identity_is_empty_when_unused():
    assert ChatOptions().identity() == {}
    assert ChatOptions("default").identity() == {"template": "default", "fewshot_as_multiturn": True}


# -- evalrun task --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task,shots,ref", [("arc_tiny", 2, CHAT), ("gsm8k_tiny", 2, CHAT),
                                            ("arc_tiny", 2, {**CHAT, "system_instruction": SYSTEM})])
def test_task_chat_equals_lm_eval(tiny_model_dir, include_path, tmp_path, task, shots, ref):
    want = run_lm_eval_reference(tiny_model_dir, [task], include_path, num_fewshot=shots, **ref)["samples"][task]
    extra = ["--system-instruction", ref["system_instruction"]] if "system_instruction" in ref else []
    _run("task", "--tasks", task, "--include-path", str(include_path), "--num-fewshot", str(shots), "--model",
         str(tiny_model_dir), "--output-dir", str(tmp_path / "t"), "--apply-chat-template", *extra)
    rows, prompts = _rows_and_prompts(tmp_path / "t")
    assert {s["doc_id"] for s in want} == set(rows)
    for doc_id, context in _reference_prompts(want).items():
        assert prompts[rows[doc_id]["prompt_hash"]] == context, f"doc {doc_id}: the prompt differs"
    for s in want:
        row = rows[s["doc_id"]]
        assert _close(json.loads(row["resps"]), s["resps"]), f"doc {s['doc_id']}: responses differ"
        assert _close(json.loads(row["filtered_resps"])[s["filter"]], s["filtered_resps"])
        metrics = json.loads(row["metrics"])
        for m in s["metrics"]:
            assert _close(metrics[f"{m},{s['filter']}"], s[m])


# -- dedup under the template ---------------------------------------------------------------------------------------

def _computed(out: Path) -> tuple[int, int]:
    throughput = json.loads((out / "manifest.json").read_text())["throughput"]
    return throughput["prefill_tokens_computed"], throughput["prompt_tokens"]


def test_dedup_stays_effective_under_the_template(tiny_model_dir, tmp_path):
    """MMLU 5-shot, 4 subjects: the system and shot turns are one shared prefix per subject, so the
    tokens computed with the template stay within 1.2x of the plain prompts' (issue 42, item 4)."""
    if not MMLU_DIR.is_dir():
        pytest.skip(f"no MMLU data at {MMLU_DIR}")
    subjects = "abstract_algebra,anatomy,astronomy,virology"
    base = ["mmlu", "--data-dir", str(MMLU_DIR), "--subjects", subjects, "--limit", "8", "--model",
            str(tiny_model_dir)]
    _run(*base, "--output-dir", str(tmp_path / "plain"))
    _run(*base, "--output-dir", str(tmp_path / "chat"), "--apply-chat-template")
    plain, chat = _computed(tmp_path / "plain"), _computed(tmp_path / "chat")
    assert chat[1] > plain[1]                      # the rendered prompts are longer ...
    assert chat[0] <= 1.2 * plain[0], (chat, plain)     # ... and still computed once per subject
    assert chat[0] < 0.5 * chat[1]


@pytest.mark.slow
def test_smollm2_mmlu_chat_equals_lm_eval_on_40_questions(smollm2_dir, include_path, tmp_path):
    """Issue 42, item 1 on the real model: SmolLM2-135M-Instruct's own template, 5-shot as turns,
    40 questions of the MMLU data (20 in each of two subjects), float32: lm-eval's prompts and
    predictions."""
    if not MMLU_DIR.is_dir():
        pytest.skip(f"no MMLU data at {MMLU_DIR}")
    subjects = ("abstract_algebra", "anatomy")
    want = run_lm_eval_reference(smollm2_dir, [f"mmlu_local_{s}" for s in subjects], include_path, num_fewshot=5,
                                 limit=20, **CHAT)["samples"]
    _run("mmlu", "--data-dir", str(MMLU_DIR), "--subjects", ",".join(subjects), "--limit", "20", "--model",
         str(smollm2_dir), "--output-dir", str(tmp_path / "m"), "--apply-chat-template")
    rows = {(r["subject"], r["doc_id"]): r for r in read_samples(tmp_path / "m").to_dict("records")}
    prompts = read_prompts(tmp_path / "m")
    assert len(rows) == 40
    for subject in subjects:
        samples = want[f"mmlu_local_{subject}"]
        assert len(samples) == 20
        for doc_id, context in _reference_prompts(samples).items():
            assert prompts[rows[(subject, doc_id)]["prompt_hash"]] == context
        for s in samples:
            lls = [resp[0][0] for resp in s["resps"]]
            row = rows[(subject, s["doc_id"])]
            assert _close(list(row["choice_logprobs"]), lls, 2e-4), (subject, s["doc_id"])
            assert row["prediction"] == "ABCD"[max(range(4), key=lambda i: (lls[i], -i))]


# -- show, thinking switches, the auto marker ---------------------------------------------------------------------

def test_show_prints_a_chat_prompt_as_roles(tiny_model_dir, tmp_path, capsys):
    if not MMLU_DIR.is_dir():
        pytest.skip(f"no MMLU data at {MMLU_DIR}")
    out = tmp_path / "m"
    _run("mmlu", "--data-dir", str(MMLU_DIR), "--subjects", "anatomy", "--limit", "1", "--num-fewshot", "2",
         "--model", str(tiny_model_dir), "--output-dir", str(out), "--apply-chat-template")
    capsys.readouterr()
    assert main(["show", str(out), "--limit", "1"]) == 0
    text = capsys.readouterr().out
    assert "<|im_start|>" not in text and "<|im_end|>" not in text
    roles = [line.strip(" |") for line in text.splitlines() if line.strip(" |").startswith("[")]
    assert roles == ["[system]", "[user]", "[assistant]", "[user]", "[assistant]", "[user]",
                     "[assistant] <- the model answers here"]
    assert "The following are multiple choice questions (with answers) about anatomy." in text


@pytest.fixture
def qwen_like_dir(tiny_model_dir, tmp_path) -> Path:
    """The tiny model with a Qwen3-style template: it takes enable_thinking and mentions </think>."""
    import shutil
    out = tmp_path / "qwen-like"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").write_text(QWEN_LIKE)
    return out


@pytest.mark.parametrize("switch,empty_think", [("--disable-thinking", True), ("--enable-thinking", False)])
def test_enable_thinking_reaches_the_template_and_the_marker_is_auto_detected(qwen_like_dir, include_path, tmp_path,
                                                                             switch, empty_think):
    out = tmp_path / "t"
    _run("task", "--tasks", "gsm8k_tiny", "--include-path", str(include_path), "--num-fewshot", "0", "--limit", "1",
         "--model", str(qwen_like_dir), "--output-dir", str(out), "--apply-chat-template", switch)
    rows, prompts = _rows_and_prompts(out)
    prompt = prompts[rows[0]["prompt_hash"]]
    assert prompt.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if empty_think else ""))
    assert "raw_resps" in rows[0]                       # </think> found in the template: thinking is stripped
    chat = json.loads((out / "manifest.json").read_text())["identity"]["chat"]
    assert chat["enable_thinking"] is (switch == "--enable-thinking")


@pytest.mark.slow
def test_smollm2_arc_style_task_chat_equals_lm_eval(smollm2_dir, include_path, tmp_path):
    """The same on a config task (the ARC-style fixture, 2-shot as turns) on SmolLM2-135M-Instruct."""
    want = run_lm_eval_reference(smollm2_dir, ["arc_tiny"], include_path, num_fewshot=2, **CHAT)["samples"]["arc_tiny"]
    _run("task", "--tasks", "arc_tiny", "--include-path", str(include_path), "--num-fewshot", "2", "--model",
         str(smollm2_dir), "--output-dir", str(tmp_path / "t"), "--apply-chat-template")
    rows, prompts = _rows_and_prompts(tmp_path / "t")
    assert {s["doc_id"] for s in want} == set(rows)
    for doc_id, context in _reference_prompts(want).items():
        assert prompts[rows[doc_id]["prompt_hash"]] == context
    for s in want:
        row = rows[s["doc_id"]]
        assert _close(json.loads(row["resps"]), s["resps"], 2e-4)
        metrics = json.loads(row["metrics"])
        for m in s["metrics"]:
            assert metrics[f"{m},{s['filter']}"] == s[m], (s["doc_id"], m)       # acc, acc_norm: the predictions

