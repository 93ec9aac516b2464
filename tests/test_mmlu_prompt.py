"""MMLU prompts and subject groups against lm-evaluation-harness's own `mmlu` task files.

lm-eval 0.4.13 is a test-only reference, installed by .ci/run with `--no-deps`. Its task loader
would download cais/mmlu (and needs the dependencies we skip), so this file reads the packaged
yaml files of the default task (lm_eval/tasks/mmlu/default/) and builds the prompt the way
`ConfigurableTask.fewshot_context` does for plain text (no chat template), with lm-eval's own
pieces: `TaskConfig` (default delimiters " " and "\\n\\n", the fewshot config), `apply_template`
(its jinja2 Environment), the `first_n` sampler and `Message`. What we copy is the yaml `include`
merge and the order of the messages in `fewshot_context`/`build_qa_turn`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path
from typing import Any, Optional

import pyarrow.parquet as pq
import pytest
import yaml

from evalrun.tasks.mmlu import MMLUTask, build_prompt
from evalrun.tasks.mmlu_data import MMLUDoc, load_mmlu
from evalrun.tasks.mmlu_groups import GROUP_DISPLAY_NAME, GROUPS, SUBJECT_GROUP, group_of

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"


def _lm_eval_task_dir() -> Optional[Path]:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "tasks" / "mmlu" / "default"
    return path if path.is_dir() else None


LM_EVAL_MMLU = _lm_eval_task_dir()
if LM_EVAL_MMLU is None:
    pytest.skip("lm_eval is not installed (`python -m pip install --no-deps lm-eval==0.4.13`, see .ci/run)",
                allow_module_level=True)
try:
    from lm_eval.api.samplers import get_sampler
    from lm_eval.api.utils import Message
    from lm_eval.config.task import TaskConfig
    from lm_eval.utils import apply_template
except ImportError as exc:
    pytest.skip(f"lm_eval is installed but its prompt modules do not import: {exc}", allow_module_level=True)


# --- lm-eval's side -----------------------------------------------------------------------------
class _TolerantLoader(yaml.SafeLoader):
    """lm-eval's loader, except that custom tags (`!function ...`) load as None instead of importing code."""


_TolerantLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _load_yaml(path: Path) -> dict[str, Any]:
    """lm_eval/tasks/_yaml_loader.load_yaml: included files first, the file's own keys win."""
    cfg = yaml.load(path.read_text(), Loader=_TolerantLoader)
    includes = cfg.pop("include", [])
    merged: dict[str, Any] = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        merged.update(_load_yaml(path.parent / inc))
    return merged | cfg


def _lm_eval_subjects() -> list[str]:
    return sorted(p.stem[len("mmlu_"):] for p in LM_EVAL_MMLU.glob("mmlu_*.yaml"))


@functools.cache
def _task_config(subject: str) -> TaskConfig:
    config = TaskConfig(**_load_yaml(LM_EVAL_MMLU / f"mmlu_{subject}.yaml"))
    fewshot = config.fewshot_config
    # NOTE: the reference below implements only what the default mmlu task uses; fail loudly otherwise
    assert config.dataset_name == subject and config.output_type == "multiple_choice"
    assert (config.test_split, fewshot.split) == ("test", "dev")
    assert config.process_docs is None and fewshot.process_docs is None and config.use_prompt is None
    assert config.gen_prefix is None and fewshot.gen_prefix is None
    return config


def _field(doc: dict[str, Any], spec: Any) -> Any:
    """ConfigurableTask.doc_to_text/doc_to_target/doc_to_choice for the spec kinds mmlu uses."""
    if isinstance(spec, list):
        return spec
    if spec in doc:
        return doc[spec]
    text = apply_template(spec, doc)
    return int(text) if text.isdigit() else text


def lm_eval_context(config: TaskConfig, fewshot_docs: list[dict], doc: dict, num_fewshot: int) -> str:
    """ConfigurableTask.fewshot_context(doc, num_fewshot) as plain text."""
    fewshot = config.fewshot_config
    description = (config.description if config.description in doc else apply_template(config.description, doc))
    messages = [Message("system", description)] if description else []
    if num_fewshot > 0:
        sampler = get_sampler(fewshot.sampler)(fewshot_docs, rnd=None)
        eval_doc = doc if fewshot.split == config.test_split else None
        for shot in sampler.sample(n=num_fewshot, eval_doc=eval_doc):
            choices, target = _field(shot, fewshot.doc_to_choice), _field(shot, fewshot.doc_to_target)
            messages += [Message("user", _field(shot, fewshot.doc_to_text), fewshot.target_delimiter),
                         Message("assistant", choices[target], fewshot.fewshot_delimiter)]
    messages.append(Message("user", _field(doc, config.doc_to_text), ""))
    return "".join(m.to_text() for m in messages)


def lm_eval_continuations(config: TaskConfig, doc: dict) -> list[str]:
    """ConfigurableTask.construct_requests for multiple_choice: one continuation per choice."""
    return [config.target_delimiter + c for c in _field(doc, config.doc_to_choice)]


# --- the two sides on the same rows ---------------------------------------------------------------
def _rows(split: str) -> dict[str, list[dict]]:
    """The fixture read directly (not through tasks.mmlu_data): {subject: [row, ...]} in file order."""
    out: dict[str, list[dict]] = {}
    for row in pq.read_table(FIXTURE / f"{split}.parquet").to_pylist():
        out.setdefault(row["subject"], []).append(row)
    return out


def _as_row(doc: MMLUDoc) -> dict:
    return {"subject": doc.subject, "question": doc.question, "choices": list(doc.choices), "answer": doc.answer}


@pytest.fixture(scope="module")
def fixture_data():
    return load_mmlu(FIXTURE)


class CharTokenizer:
    """One token per character, so a request's ids decode back to its exact text."""

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]


def test_fixture_covers_all_four_groups():
    assert {group_of(s) for s in _rows("test")} == set(GROUPS)


@pytest.mark.parametrize("num_fewshot", [0, 1, 5])
@pytest.mark.parametrize("subject", sorted(_rows("test")))
def test_build_prompt_matches_lm_eval(fixture_data, subject, num_fewshot):
    config, dev, test = _task_config(subject), _rows("dev")[subject], _rows("test")[subject]
    assert len(test) == len(fixture_data.test[subject]) >= 5
    for doc, row in zip(fixture_data.test[subject], test):
        ours = build_prompt(subject, fixture_data.dev[subject][:num_fewshot], doc)
        assert ours == lm_eval_context(config, dev, row, num_fewshot)


@pytest.mark.parametrize("num_fewshot", [0, 5])
def test_task_requests_match_lm_eval(fixture_data, num_fewshot):
    """What MMLUTask actually sends: prompt ids and the continuation of each choice."""
    task = MMLUTask(data=fixture_data, num_fewshot=num_fewshot)
    dev, test = _rows("dev"), _rows("test")
    plans = list(task.plan(CharTokenizer(), max_seq_len=1 << 20))
    assert len(plans) == sum(len(v) for v in test.values())
    for plan in plans:
        subject, doc_id = plan.doc_key
        config, row = _task_config(subject), test[subject][doc_id]
        assert plan.info["num_fewshot_used"] == num_fewshot
        assert "".join(map(chr, plan.requests[0].input_ids)) == lm_eval_context(config, dev[subject], row, num_fewshot)
        assert ["".join(map(chr, ids)) for ids in task.choice_ids] == lm_eval_continuations(config, row)


def test_all_57_descriptions_and_awkward_text():
    """Every subject's preamble, on rows with whitespace, jinja syntax, HTML and unicode in them."""
    shots = [MMLUDoc("s", 0, "  What is 2+2?\n", ("3 ", " 4", "{{ x }}", "<b>&amp;</b>"), 1),
             MMLUDoc("s", 1, "\tLine one\n\nline two  ", ("α", "β\n", "", "{% raw %}"), 3)]
    doc = MMLUDoc("s", 2, "\u00a0Trailing newline?\n\n", ("a\\n", "b", "c", "d"), 0)
    subjects = _lm_eval_subjects()
    assert len(subjects) == 57
    for subject in subjects:
        config = _task_config(subject)
        for k in range(len(shots) + 1):
            ours = build_prompt(subject, shots[:k], dataclasses.replace(doc, subject=subject))
            assert ours == lm_eval_context(config, [_as_row(s) for s in shots], _as_row(doc), k), subject


# --- groups ---------------------------------------------------------------------------------------
def test_subject_groups_match_lm_eval():
    """Each `mmlu_<subject>.yaml` tags itself `mmlu_<group>_tasks`; `_mmlu_<group>.yaml` collects that tag."""
    top = _load_yaml(LM_EVAL_MMLU / "_mmlu.yaml")
    assert top["group"] == "mmlu"
    group_files = {g: _load_yaml(LM_EVAL_MMLU / f"_{g}.yaml") for g in top["task"]}
    tag_to_group = {}
    for name, cfg in group_files.items():
        assert cfg["group"] == name and len(cfg["task"]) == 1
        tag_to_group[cfg["task"][0]] = name.removeprefix("mmlu_")
    assert set(tag_to_group.values()) == set(GROUPS)
    assert {name.removeprefix("mmlu_"): cfg["group_alias"] for name, cfg in group_files.items()} == GROUP_DISPLAY_NAME
    theirs = {s: tag_to_group[_load_yaml(LM_EVAL_MMLU / f"mmlu_{s}.yaml")["tag"]] for s in _lm_eval_subjects()}
    assert len(theirs) == 57
    assert SUBJECT_GROUP == theirs


def test_group_of():
    assert group_of("philosophy") == "humanities" and group_of("high_school_geography") == "social_sciences"
    assert group_of("my_company_trivia") is None and group_of("") is None


# --- aggregation: lm-eval's own metric functions ----------------------------------------------------
def _lm_eval_metric_functions(*names: str) -> dict[str, Any]:
    """Functions from lm_eval/api/metrics.py, compiled from its source: importing that module
    needs sacrebleu and more, which the --no-deps install leaves out."""
    import ast
    import math

    import numpy as np
    source = (LM_EVAL_MMLU.parents[2] / "api" / "metrics.py").read_text()
    tree = ast.parse(source)
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    for node in wanted:
        node.decorator_list = []                 # registry decorators are not needed here
    scope: dict[str, Any] = {"np": np, "math": math, "List": list}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "lm_eval/api/metrics.py", "exec"), scope)
    return {n: scope[n] for n in names}


def test_group_and_overall_figures_aggregate_as_lm_eval(fixture_data):
    """Accuracy weighted by questions, stderr = lm-eval's pooled_sample_stderr over the subjects'
    stderrs (each lm-eval's mean_stderr), on uneven subjects."""
    f = _lm_eval_metric_functions("sample_stddev", "mean_stderr", "pooled_sample_stderr", "mean")
    task = MMLUTask(data=fixture_data)
    rng = __import__("random").Random(7)
    sizes = {"abstract_algebra": 8, "high_school_biology": 3, "philosophy": 7, "high_school_geography": 1,
             "nutrition": 5}
    rows = [{"subject": s, "doc_id": i, "correct": rng.random() < 0.4 + 0.1 * k}
            for k, (s, n) in enumerate(sizes.items()) for i in range(n)]
    per_subject, overall = task.summarize(rows)

    def lm_eval(subjects: list[str]) -> tuple[float, float]:
        values = {s: [float(r["correct"]) for r in rows if r["subject"] == s] for s in subjects}
        stderrs = [f["mean_stderr"](v) if len(v) > 1 else 0.0 for v in values.values()]
        sizes_ = [len(v) for v in values.values()]
        acc = sum(f["mean"](v) * len(v) for v in values.values()) / sum(sizes_)
        return acc, float(f["pooled_sample_stderr"](stderrs, sizes_))

    for s in per_subject:
        if s["n"] > 1:
            assert s["stderr"] == pytest.approx(f["mean_stderr"]([float(r["correct"]) for r in rows
                                                                   if r["subject"] == s["subject"]]))
    acc, err = lm_eval(list(sizes))
    assert (overall["accuracy"], overall["stderr"]) == pytest.approx((acc, err))
    stem = [s for s in sizes if SUBJECT_GROUP[s] == "stem"]
    acc, err = lm_eval(stem)
    assert (overall["groups"]["stem"]["accuracy"], overall["groups"]["stem"]["stderr"]) == pytest.approx((acc, err))
