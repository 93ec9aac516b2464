"""lm-eval's `--model evalrun` under `--apply_chat_template` (evalrun/lm_eval_backend.py): the prompts lm-eval
builds through our renderer equal, character for character, those its HF backend builds through transformers
(float32, same tiny model), and the responses, filtered responses and metrics are the HF backend's; a named
template renders where asked; enable_thinking reaches the template as the HF backend passes it; bad thinking
settings are one line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sacrebleu", reason="lm-eval's TaskManager imports sacrebleu: install evalrun[lm-eval]")

import evalrun.lm_eval_backend  # noqa: E402,F401 - registers "evalrun"
from evalrun.engine.chat_template import ChatTemplateError  # noqa: E402
from evalrun.errors import BadInput  # noqa: E402
from lm_eval_fixtures import QWEN_LIKE, close as _close, run_evalrun_backend, run_lm_eval_reference, write_fixture_tasks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAT = {"apply_chat_template": True, "fewshot_as_multiturn": True}
SINGLE_TURN = {"apply_chat_template": True, "fewshot_as_multiturn": False}
SYSTEM = {**CHAT, "system_instruction": "Answer with the letter only."}
MARK = "NAMED|"


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> Path:
    return write_fixture_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), None)


@pytest.fixture(scope="module")
def templated_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a Qwen3-style default template (it takes enable_thinking) and a named one that
    writes MARK before what the default writes."""
    out = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").write_text(QWEN_LIKE)
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "marked.jinja").write_text(MARK + QWEN_LIKE)
    return out


def _ours(model_dir: Path, task: str, include_path: Path, shots: int, model_args: str = "",
          limit: Any = None, **chat: Any) -> dict:
    return run_evalrun_backend(model_dir, [task], include_path, shots, limit, model_args, **chat)


def _assert_same_samples(ours: list[dict], ref: list[dict], task: str) -> None:
    mine = {(s["doc_id"], s["filter"]): s for s in ours}
    assert len(mine) == len(ref) > 0
    for s in ref:
        o, where = mine[(s["doc_id"], s["filter"])], f"{task} doc {s['doc_id']}"
        assert o["arguments"] == s["arguments"], f"{where}: the prompts or requests differ"
        assert _close(o["resps"], s["resps"]), f"{where}: responses differ"
        assert _close(o["filtered_resps"], s["filtered_resps"]), f"{where}: filtered responses differ"
        for m in s["metrics"]:
            assert _close(o[m], s[m]), f"{where}: {m} differs"


@pytest.mark.parametrize("task,chat", [("arc_tiny", CHAT), ("gsm8k_tiny", CHAT), ("arc_tiny", SYSTEM),
                                       ("gsm8k_tiny", SINGLE_TURN)])
def test_chat_prompts_and_answers_equal_lm_eval_hf(tiny_model_dir, include_path, task, chat):
    ref = run_lm_eval_reference(tiny_model_dir, [task], include_path, num_fewshot=2, **chat)
    ours = _ours(tiny_model_dir, task, include_path, 2, **chat)
    assert all("<|im_start|>" in s["arguments"][0][0] for s in ref["samples"][task])     # the template ran
    _assert_same_samples(ours["samples"][task], ref["samples"][task], task)
    for key, want in ref["results"][task].items():
        if "," in key:
            assert _close(ours["results"][task][key], want, 1e-6), f"{task}: {key}"


@pytest.mark.parametrize("enable", [False, True])
def test_enable_thinking_reaches_the_template_as_the_hf_backend_passes_it(templated_dir, include_path, enable):
    args = f"enable_thinking={enable},think_end_token=</think>"
    ref = run_lm_eval_reference(templated_dir, ["gsm8k_tiny"], include_path, num_fewshot=0, limit=3,
                                model_args=args, **CHAT)["samples"]["gsm8k_tiny"]
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert all(s["arguments"][0][0].endswith(empty_think) is not enable for s in ref)
    ours = _ours(templated_dir, "gsm8k_tiny", include_path, 0, args, limit=3, **CHAT)["samples"]["gsm8k_tiny"]
    _assert_same_samples(ours, ref, "gsm8k_tiny")


def test_a_named_template_renders_the_prompts(templated_dir, include_path, tmp_path):
    """model_args chat_template=NAME: everything is as the HF backend gives on a copy of the model whose
    default template is that one (MARK + the default's; lm-eval's HF backend renders the default only)."""
    marked = tmp_path / "marked-default"
    shutil.copytree(templated_dir, marked)
    shutil.move(marked / "additional_chat_templates" / "marked.jinja", marked / "chat_template.jinja")
    ref = run_lm_eval_reference(marked, ["arc_tiny"], include_path, num_fewshot=2, **CHAT)["samples"]["arc_tiny"]
    assert all(s["arguments"][0][0].startswith(MARK + "<|im_start|>") for s in ref)
    ours = _ours(templated_dir, "arc_tiny", include_path, 2, "chat_template=marked", **CHAT)["samples"]["arc_tiny"]
    _assert_same_samples(ours, ref, "arc_tiny")


def test_the_lm_selects_the_template_lm_eval_names(templated_dir):
    """lm-eval's `--apply_chat_template NAME` reaches the LM as chat_template(NAME), before any prompt."""
    from lm_eval.api.registry import get_model
    lm = get_model("evalrun").create_from_arg_string(f"pretrained={templated_dir},dtype=float32")
    assert lm.chat_template(False) is None
    assert lm.chat_template(True) == QWEN_LIKE
    before = lm.tokenizer_name
    messages = [{"role": "user", "content": "2 + 2?"}]
    assert lm.apply_chat_template(messages) == "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert lm.chat_template("marked") == MARK + QWEN_LIKE
    assert lm.apply_chat_template(messages).startswith(MARK + "<|im_start|>user")
    assert lm.tokenizer_name != before              # lm-eval's request cache keys the template
    with pytest.raises(ChatTemplateError, match="'nope'"):
        lm.chat_template("nope")
    # a last assistant message is continued (HF: continue_final_message when no generation prompt is added)
    cont = lm.apply_chat_template(messages + [{"role": "assistant", "content": "The answer is"}], False)
    assert cont.endswith("<|im_start|>assistant\nThe answer is")


def test_cli_records_the_template_and_gives_the_hf_numbers(tiny_model_dir, include_path, tmp_path):
    ref = run_lm_eval_reference(tiny_model_dir, ["arc_tiny"], include_path, num_fewshot=2, **CHAT)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "evalrun.lm_eval_backend", "--model", "evalrun", "--model_args",
                           f"pretrained={tiny_model_dir},dtype=float32", "--tasks", "arc_tiny", "--include_path",
                           str(include_path), "--num_fewshot", "2", "--apply_chat_template", "--fewshot_as_multiturn",
                           "--output_path", str(out)],
                          cwd=ROOT, env={**os.environ, "USE_HUB_KERNELS": "0"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [results] = out.rglob("results_*.json")
    got = json.loads(results.read_text())
    assert got["chat_template"] == (tiny_model_dir / "chat_template.jinja").read_text()
    assert got["chat_template_sha"] and got["fewshot_as_multiturn"] is True
    for key in ("acc,none", "acc_norm,none"):
        assert _close(got["results"]["arc_tiny"][key], ref["results"]["arc_tiny"][key], 1e-9), key


@pytest.mark.parametrize("args,match", [
    ("enable_thinking=true", "needs think_end_token"),                 # no </think> in this model's template
    ("max_thinking_tokens=8", "needs a marker"),
    ("think_end_token=99999999", "think_end_token"),
    ("enable_thinking=maybe", "true or false"),
    ("think_end_token=</think>,max_thinking_tokens=-1", "non-negative integer"),
])
def test_bad_thinking_settings_are_one_line(tiny_model_dir, args, match):
    from lm_eval.api.registry import get_model
    with pytest.raises(BadInput, match=match) as info:
        get_model("evalrun").create_from_arg_string(f"pretrained={tiny_model_dir},{args}")
    assert "\n" not in str(info.value)


def test_a_model_without_a_template_is_one_line(tiny_model_dir, tmp_path):
    from lm_eval.api.registry import get_model
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "chat_template.jinja").unlink()
    lm = get_model("evalrun").create_from_arg_string(f"pretrained={bare}")
    with pytest.raises(ChatTemplateError, match="no chat template") as info:
        lm.chat_template(True)
    assert "\n" not in str(info.value)
