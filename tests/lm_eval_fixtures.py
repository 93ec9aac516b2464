"""lm-evaluation-harness task fixtures, and lm-eval 0.4.13 itself as their reference.

`write_fixture_tasks(root)` writes an lm-eval `--include-path` directory of small tasks in lm-eval's
own YAML formats (copied from its packaged arc_easy, hellaswag, gsm8k, wikitext and mmlu/default
files) over made-up local data. `run_lm_eval_reference(...)` runs lm-eval's HF backend on them
(float32, CPU, batch size 1, lm-eval's default seeds) and returns its results and per-document
samples, so that evalrun's implementation of these YAML tasks can be compared with lm-eval's.

Layout under root (deterministic; the YAMLs name their data files by absolute path)::

    data/<task>/<split>.jsonl
    tasks/                                      <- the include path (returned)
        arc_tiny/arc_tiny.yaml
        hellaswag_tiny/hellaswag_tiny.yaml      process_docs: !function utils.process_docs
        hellaswag_tiny/utils.py
        gsm8k_tiny/gsm8k_tiny.yaml              tag tiny_tag
        wikitext_tiny/wikitext_tiny.yaml        tag tiny_tag; doc_to_target and process_results
        wikitext_tiny/preprocess_wikitext.py    are lm-eval's wikitext !functions
        arc_mi_tiny/arc_mi_tiny.yaml            tag tiny_loglik; arc_tiny's data, + acc_mutual_info
        lambada_tiny/lambada_tiny.yaml          tag tiny_loglik; output_type loglikelihood
        winogrande_tiny/winogrande_tiny.yaml    tag tiny_loglik; the choices are contexts, the continuation shared;
        winogrande_tiny/preprocess_winogrande.py    lm-eval's own !function module, copied
        tiny_suite.yaml                         group: arc_tiny + hellaswag_tiny
        mmlu_local/                             only with mmlu_dir: mmlu_local_<subject> + group
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any, Iterator, Optional, Sequence

from evalrun.tasks.lm_eval_code import code_eval_in_sandbox
from reference_cache import cached
from lm_eval_fixture_data import ARC_TRAIN, ARC_TEST, HELLASWAG_TRAIN, HELLASWAG_VALIDATION, GSM8K_TRAIN, GSM8K_TEST, LAMBADA_TEST, WIKITEXT_TEST, WINOGRANDE_TRAIN, WINOGRANDE_VALIDATION  # noqa: E402
from lm_eval_fixture_texts import (ARC_YAML, ARC_MI_YAML, LAMBADA_YAML, HELLASWAG_YAML, HELLASWAG_UTILS, GSM8K_YAML, WIKITEXT_YAML, TINY_SUITE_YAML, MMLU_SUBJECT_YAML, MMLU_GROUP_YAML, MMLU_UTILS_HEAD, MMLU_UTILS_SUBJECT, WIKITEXT_UTILS)  # noqa: E402


@dataclass(frozen=True)
class FixtureTask:
    name: str
    output_type: str
    num_docs: Optional[int]  # docs in the evaluated split; None: counted from the MMLU parquet
    eval_split: str
    fewshot_split: Optional[str]  # None: lm-eval's fallback (training docs for hellaswag)
    metrics: tuple[str, ...]
    filters: tuple[str, ...] = ("none",)


MMLU_SUBJECTS = ("abstract_algebra", "anatomy")

GROUPS = {"tiny_suite": ("arc_tiny", "hellaswag_tiny"), "mmlu_local": tuple(f"mmlu_local_{s}" for s in MMLU_SUBJECTS)}
TAGS = {"tiny_tag": ("gsm8k_tiny", "wikitext_tiny"),
        "tiny_loglik": ("arc_mi_tiny", "lambada_tiny", "winogrande_tiny")}




FIXTURE_TASKS: dict[str, FixtureTask] = {
    "arc_tiny": FixtureTask("arc_tiny", "multiple_choice", len(ARC_TEST), "test", "train", ("acc", "acc_norm")),
    "hellaswag_tiny": FixtureTask(
        "hellaswag_tiny", "multiple_choice", len(HELLASWAG_VALIDATION), "validation", None, ("acc", "acc_norm")
    ),
    "gsm8k_tiny": FixtureTask(
        "gsm8k_tiny", "generate_until", len(GSM8K_TEST), "test", "train", ("exact_match",),
        filters=("strict-match", "flexible-extract"),
    ),
    "wikitext_tiny": FixtureTask(
        "wikitext_tiny", "loglikelihood_rolling", len(WIKITEXT_TEST), "test", None,
        ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    ),
    "arc_mi_tiny": FixtureTask(
        "arc_mi_tiny", "multiple_choice", len(ARC_TEST), "test", "train", ("acc", "acc_norm", "acc_mutual_info")
    ),
    "lambada_tiny": FixtureTask("lambada_tiny", "loglikelihood", len(LAMBADA_TEST), "test", None, ("perplexity", "acc")),
    "winogrande_tiny": FixtureTask("winogrande_tiny", "multiple_choice", len(WINOGRANDE_VALIDATION), "validation",
                                   None, ("acc",)),
}
MMLU_TASKS: dict[str, FixtureTask] = {
    f"mmlu_local_{subject}": FixtureTask(f"mmlu_local_{subject}", "multiple_choice", None, "test", "dev", ("acc",))
    for subject in MMLU_SUBJECTS
}


def _arc_rows(rows: list[tuple]) -> list[dict[str, Any]]:
    out = []
    for id_, question, texts, label_style, answer in rows:
        labels = [chr(ord("A") + i) if label_style == "A" else str(i + 1) for i in range(len(texts))]
        out.append({"id": id_, "question": question, "choices": {"text": texts, "label": labels},
                    "answerKey": labels[answer]})
    return out


def _hellaswag_rows(rows: list[tuple], split: str, first_ind: int) -> list[dict[str, Any]]:
    out = []
    for i, (activity, ctx_a, ctx_b, endings, label, source_id) in enumerate(rows):
        ctx = f"{ctx_a} {ctx_b}" if ctx_b else ctx_a  # as in the dataset: WikiHow rows have ctx == ctx_a
        split_type = "zeroshot" if i % 4 == 3 else "indomain"
        out.append({"ind": first_ind + i, "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": ctx,
                    "endings": endings, "source_id": source_id, "split": split, "split_type": split_type,
                    "label": label})
    return out


def fixture_rows() -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{task: {split: rows}}: the rows write_fixture_tasks writes, in the public datasets' schemas
    (before process_docs), in file order."""
    return {
        "arc_tiny": {"train": _arc_rows(ARC_TRAIN), "test": _arc_rows(ARC_TEST)},
        "hellaswag_tiny": {"train": _hellaswag_rows(HELLASWAG_TRAIN, "train", 0),
                           "validation": _hellaswag_rows(HELLASWAG_VALIDATION, "val", 1000)},
        "gsm8k_tiny": {"train": [{"question": q, "answer": a} for q, a in GSM8K_TRAIN],
                       "test": [{"question": q, "answer": a} for q, a in GSM8K_TEST]},
        "wikitext_tiny": {"test": [{"page": page} for page in WIKITEXT_TEST]},
        "lambada_tiny": {"test": [{"text": text} for text in LAMBADA_TEST]},
        "winogrande_tiny": {split: [{"sentence": s, "option1": o1, "option2": o2, "answer": a} for s, o1, o2, a in rows]
                            for split, rows in (("train", WINOGRANDE_TRAIN), ("validation", WINOGRANDE_VALIDATION))},
    }



# --- writer ------------------------------------------------------------------------------------
def write_fixture_tasks(root: Path, mmlu_dir: Optional[Path] = None) -> Path:
    """Write the fixture tasks and their data under `root`; return the include path (root/"tasks").

    Tasks: arc_tiny, hellaswag_tiny, gsm8k_tiny, wikitext_tiny, arc_mi_tiny, lambada_tiny, winogrande_tiny (see
    FIXTURE_TASKS), the group tiny_suite (arc_tiny + hellaswag_tiny) and the tags tiny_tag
    (gsm8k_tiny + wikitext_tiny) and tiny_loglik (arc_mi_tiny, lambada_tiny, winogrande_tiny).
    With `mmlu_dir` (cais/mmlu-schema dev.parquet and test.parquet holding every subject) also
    mmlu_local_<subject> for MMLU_SUBJECTS and their group mmlu_local; these include lm-eval's
    packaged mmlu/default/_default_template_yaml by absolute path, so they need lm_eval installed.
    """
    root = Path(root).resolve()
    tasks_dir = root / "tasks"
    data_files = _write_data(root / "data")
    for task, (template, helper) in {
        "arc_tiny": (ARC_YAML, None),
        "hellaswag_tiny": (HELLASWAG_YAML, ("utils.py", HELLASWAG_UTILS)),
        "gsm8k_tiny": (GSM8K_YAML, None),
        "wikitext_tiny": (WIKITEXT_YAML, ("preprocess_wikitext.py", WIKITEXT_UTILS)),
        "arc_mi_tiny": (ARC_MI_YAML, None),
        "lambada_tiny": (LAMBADA_YAML, None),
        "winogrande_tiny": (winogrande_yaml(), ("preprocess_winogrande.py",
                                                lm_eval_task_file("winogrande/preprocess_winogrande.py"))),
    }.items():
        data = data_files["arc_tiny" if task == "arc_mi_tiny" else task]
        paths = {split: json.dumps(str(path)) for split, path in data.items()}
        _write(tasks_dir / task / f"{task}.yaml", Template(template).substitute(paths))
        if helper is not None:
            _write(tasks_dir / task / helper[0], helper[1])
    _write(tasks_dir / "tiny_suite.yaml", TINY_SUITE_YAML)
    if mmlu_dir is not None:
        _write_mmlu_tasks(tasks_dir / "mmlu_local", Path(mmlu_dir).resolve())
    return tasks_dir


def _write_data(data_dir: Path) -> dict[str, dict[str, Path]]:
    files: dict[str, dict[str, Path]] = {}
    for task, splits in fixture_rows().items():
        for split, rows in splits.items():
            path = data_dir / task / f"{split}.jsonl"
            _write(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
            files.setdefault(task, {})[split] = path
    return files


def _write_mmlu_tasks(out_dir: Path, mmlu_dir: Path) -> None:
    template = lm_eval_mmlu_template()
    utils = MMLU_UTILS_HEAD
    for subject in MMLU_SUBJECTS:
        description = mmlu_description(subject)
        _write(out_dir / f"mmlu_local_{subject}.yaml", Template(MMLU_SUBJECT_YAML).substitute(
            template=json.dumps(str(template)), subject=subject, description=json.dumps(description),
            test=json.dumps(str(mmlu_dir / "test.parquet")), dev=json.dumps(str(mmlu_dir / "dev.parquet")),
        ))
        utils += Template(MMLU_UTILS_SUBJECT).substitute(subject=subject)
    _write(out_dir / "mmlu_utils.py", utils)
    members = "".join(f"  - mmlu_local_{subject}\n" for subject in MMLU_SUBJECTS).rstrip("\n")
    _write(out_dir / "_mmlu_local.yaml", Template(MMLU_GROUP_YAML).substitute(members=members))


def mmlu_description(subject: str) -> str:
    """The `description` of lm-eval's mmlu/default/mmlu_<subject>.yaml."""
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def lm_eval_task_file(relative: str) -> str:
    """The text of one of lm-eval's packaged task files, lm_eval/tasks/<relative>."""
    import lm_eval

    path = Path(lm_eval.__file__).resolve().parent / "tasks" / relative
    if not path.is_file():
        raise FileNotFoundError(f"lm-eval's task file is missing: {path}")
    return path.read_text(encoding="utf-8")


def winogrande_yaml() -> str:
    """lm-eval's packaged winogrande/default.yaml as the task winogrande_tiny (tag tiny_loglik) over the
    local json files $train and $validation (a string.Template)."""
    text = lm_eval_task_file("winogrande/default.yaml")
    hub = "dataset_path: allenai/winogrande\ndataset_name: winogrande_xl\n"
    if not text.startswith("task: winogrande\n") or hub not in text:
        raise ValueError("lm-eval's winogrande/default.yaml is not the 0.4.13 file these fixtures rewrite")
    local = ("dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n    train: $train\n"
             "    validation: $validation\n")
    return "tag:\n  - tiny_loglik\ntask: winogrande_tiny\n" + text[len("task: winogrande\n"):].replace(hub, local)


def write_code_tasks(root: Path, problems: Sequence[Any]) -> Path:
    """lm-eval's code tasks (unsafe_code) over local data, in root/humaneval and root/mbpp: lm-eval's packaged
    humaneval.yaml and utils.py as humaneval_local over the HumanEval `problems` (HumanEvalProblem records), and
    humaneval_canonical: the same with a filter that answers each problem with its canonical solution; and
    mbpp_reference (_mbpp_tasks)."""
    he = root / "humaneval"
    he.mkdir(parents=True)
    data = he / "humaneval.jsonl"
    data.write_text("".join(json.dumps({"task_id": p.task_id, "prompt": p.prompt, "canonical_solution":
                                        p.canonical_solution, "test": p.test, "entry_point": p.entry_point}) + "\n"
                            for p in problems))
    text = lm_eval_task_file("humaneval/humaneval.yaml")
    hub = "task: humaneval\ndataset_path: openai/openai_humaneval\n"
    assert text.startswith(hub) and "unsafe_code: true" in text
    local = f"task: humaneval_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    (he / "humaneval_local.yaml").write_text(local + text[len(hub):].replace("max_gen_toks: 1024", "max_gen_toks: 8"))
    (he / "utils.py").write_text(lm_eval_task_file("humaneval/utils.py"))
    (he / "hooks.py").write_text("def canonical(resps, docs):\n"
                                 "    return [[d['prompt'] + d['canonical_solution'] for _ in r] "
                                 "for r, d in zip(resps, docs)]\n")
    (he / "humaneval_canonical.yaml").write_text(
        "include: humaneval_local.yaml\ntask: humaneval_canonical\nfilter_list:\n  - name: create_test\n"
        "    filter:\n      - function: custom\n        filter_fn: !function hooks.canonical\n")
    _mbpp_tasks(root / "mbpp")
    return root


def _mbpp_tasks(mbpp: Path) -> None:
    """lm-eval's packaged mbpp.yaml and utils.py as mbpp_reference over its own three few-shot problems (real MBPP
    solutions and asserts), with a filter that answers each with its reference solution."""
    mbpp.mkdir()
    (mbpp / "utils.py").write_text(lm_eval_task_file("mbpp/utils.py") + "\n\ndef reference(resps, docs):\n"
                                   "    return [[d['code'] for _ in r] for r, d in zip(resps, docs)]\n")
    spec = importlib.util.spec_from_file_location("mbpp_utils", mbpp / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    with code_eval_in_sandbox():                 # its import loads code_eval and checks one program
        spec.loader.exec_module(utils)
    data = mbpp / "mbpp.jsonl"
    data.write_text("".join(json.dumps({k: v for k, v in d.items() if k != "is_fewshot"}) + "\n"
                            for d in utils.list_fewshot_samples()))
    text = lm_eval_task_file("mbpp/mbpp.yaml")
    hub = "task: mbpp\ndataset_path: google-research-datasets/mbpp\ndataset_name: full\n"
    assert text.startswith(hub) and "unsafe_code: true" in text and "num_fewshot: 3" in text
    local = f"task: mbpp_reference\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    (mbpp / "mbpp_reference.yaml").write_text(
        local + text[len(hub):].replace("num_fewshot: 3", "num_fewshot: 1") + "filter_list:\n  - name: reference\n"
        "    filter:\n      - function: custom\n        filter_fn: !function utils.reference\n")


def lm_eval_mmlu_template() -> Path:
    """lm-eval's packaged lm_eval/tasks/mmlu/default/_default_template_yaml."""
    import lm_eval

    path = Path(lm_eval.__file__).resolve().parent / "tasks" / "mmlu" / "default" / "_default_template_yaml"
    if not path.is_file():
        raise FileNotFoundError(f"lm-eval's MMLU template is missing: {path}")
    return path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


# --- lm-eval as the reference -----------------------------------------------------------------
def run_lm_eval_reference(
    model_dir: Path,
    tasks: list[str],
    include_path: Path,
    num_fewshot: Optional[int] = None,
    limit: Optional[int] = None,
    model_args: str = "",
    **chat: Any,
) -> dict:
    """Run lm-eval 0.4.13's `simple_evaluate` (HF backend, float32, CPU, batch size 1, default
    seeds: random 0, numpy / torch / few-shot sampler 1234, 100000 bootstrap iterations) on
    `tasks` (task, group or tag names) from `include_path` alone (no packaged tasks indexed);
    `model_args`: more of the HF backend's model_args ("k=v,..."); `chat`: simple_evaluate's chat
    arguments (apply_chat_template, fewshot_as_multiturn, system_instruction). A result another xdist
    worker computed in this test run from byte-identical inputs is read back (tests/reference_cache.py).

    Returns, JSON round-tripped (tuples become lists, numpy scalars floats, non-JSON objects str):
      results           {task or group: {"name", "alias", "sample_len", "<metric>,<filter>": value,
                         "<metric>_stderr,<filter>": value or "N/A", ...}}
      groups (only when a group ran), group_subtasks, configs, versions, n-shot, higher_is_better,
      n-samples ({task: {"original", "effective"}}): as lm-eval's
      samples           {task: [sample, ...]}, one sample per (doc, filter), docs in order per filter:
        doc_id          index in the evaluated split (after process_docs)
        doc             the document as the task saw it (after process_docs)
        target          doc_to_target(doc) (an int index for multiple_choice)
        arguments       one entry per request: [context, continuation] (loglikelihood, one per
                        choice), [context, generation_kwargs] (generate_until), [text] (rolling)
        resps           per request, a list of the model's raw answers: [[logprob, is_greedy]]
                        (loglikelihood), [text] (generate_until), [logprob] (rolling)
        filtered_resps  per request the filtered answer: [logprob, is_greedy], the extracted text,
                        or the logprob
        filter          the filter name ("none" unless the task has a filter_list)
        metrics         the metric names; each metric's per-doc value is also a key of the sample
                        (acc: 0.0/1.0; word_perplexity etc.: [logprob, words or bytes])
        doc_hash, prompt_hash, target_hash: lm-eval's sha256 hex digests
    """
    args = [str(t) for t in tasks], num_fewshot, limit, model_args, chat
    return cached("lm-eval-hf", args, [model_dir, include_path],
                  lambda: _run_lm_eval(model_dir, tasks, include_path, num_fewshot, limit, model_args, **chat))


def _run_lm_eval(model_dir: Path, tasks: list[str], include_path: Path, num_fewshot: Optional[int],
                 limit: Optional[int], model_args: str, **chat: Any) -> dict:
    # NOTE: USE_HUB_KERNELS=0 keeps transformers 5 from loading Hugging Face's `kernels` package;
    # DISABLE_MULTIPROC=1 runs lm-eval's stderr bootstrap in this process (the same numbers; its pool of
    # workers forked from a test process that ran the engine can hang);
    # simple_evaluate seeds python's, numpy's and torch's global generators, which are restored after.
    with _environ(USE_HUB_KERNELS="0", DISABLE_MULTIPROC="1"), _kept_random_state():
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable

        out = simple_evaluate(
            model="hf",
            model_args=f"pretrained={model_dir},dtype=float32" + (f",{model_args}" if model_args else ""),
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=TaskManager(include_path=str(include_path), include_defaults=False),
            log_samples=True,
            batch_size=1,
            device="cpu",
            **chat,
        )
    keys = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better",
            "n-samples", "samples")
    kept = {key: out[key] for key in keys if key in out}
    return json.loads(json.dumps(kept, default=handle_non_serializable))


def run_evalrun_backend(model_dir: Path, tasks: list[str], include_path: Path, num_fewshot: Optional[int] = None,
                        limit: Optional[int] = None, model_args: str = "", **chat: Any) -> dict:
    """lm-eval's simple_evaluate with model="evalrun" (float32), its results and samples JSON round-tripped
    as run_lm_eval_reference returns them; the arguments as run_lm_eval_reference's."""
    import evalrun.lm_eval_backend  # noqa: F401 - registers "evalrun"
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable
    with _kept_random_state():
        out = simple_evaluate(model="evalrun", model_args=f"pretrained={model_dir},dtype=float32" +
                              (f",{model_args}" if model_args else ""), tasks=list(tasks), num_fewshot=num_fewshot,
                              limit=limit, log_samples=True,
                              task_manager=TaskManager(include_path=str(include_path), include_defaults=False), **chat)
    return json.loads(json.dumps({k: out[k] for k in ("results", "samples")}, default=handle_non_serializable))


# A Qwen3-style chat template: it takes enable_thinking and mentions </think>
QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n"
             "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
             "{% endif %}")


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _kept_random_state() -> Iterator[None]:
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


# (task, num_fewshot) that tests/test_lm_eval_tasks.py and tests/test_lm_eval_backend.py hold equal to lm-eval
REFERENCE_CASES = [("arc_tiny", 2), ("hellaswag_tiny", 2), ("gsm8k_tiny", 2), ("wikitext_tiny", 0),
                   ("mmlu_local_abstract_algebra", 5), ("arc_mi_tiny", 2), ("lambada_tiny", 0), ("winogrande_tiny", 2)]


def aggregate_close(key: str, ours: Any, theirs: Any) -> bool:
    """An aggregate "<metric>,<filter>" equal to lm-eval's: within 1e-6, except the `perplexity`
    aggregation (and its bootstrap stderr), exp(-mean log-likelihood) of short continuations, whose
    relative error is the log-likelihoods' absolute one: within their 1e-4."""
    return close(ours, theirs, 1e-4 if key.split(",")[0] in ("perplexity", "perplexity_stderr") else 1e-6)


def close(a: Any, b: Any, tol: float = 1e-4) -> bool:
    """Responses, metrics or aggregates equal: numbers within tol (absolute or relative), lists item by
    item (a tuple and a list alike, as JSON gives them), anything else exactly."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), abs_tol=tol, rel_tol=tol)
    return a == b
