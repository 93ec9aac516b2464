"""The lm-eval fixture tasks (tests/lm_eval_fixtures.py) load in lm-eval's TaskManager, and lm-eval's
own run on them (the reference for evalrun's YAML tasks) gives per-document samples with every metric.

The prompt checks rebuild lm-eval's contexts from the fixture rows, pinning what an implementation
must match: the default few-shot sampler is one `random.Random(1234)` per task drawn once per
document in document order (n + 1 docs, minus the document itself, when the task has neither a
fewshot_split nor a test_split, as hellaswag), `first_n` takes the split's first n rows after
process_docs, and a shot is text + " " + answer + "\\n\\n".
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
try:
    import sacrebleu  # noqa: F401  (lm_eval.api.metrics imports it)

    import lm_eval.evaluator  # noqa: F401
    import lm_eval.models.huggingface  # noqa: F401
except ImportError as exc:
    pytest.skip(f"lm_eval is installed without its evaluator's dependencies (CI installs it with --no-deps): {exc}",
                allow_module_level=True)

from evalrun.tasks.lm_eval_index import task_manager
from lm_eval_fixtures import (
    ARC_TEST, ARC_TRAIN, FIXTURE_TASKS, GROUPS, GSM8K_TEST, GSM8K_TRAIN, HELLASWAG_TRAIN, HELLASWAG_VALIDATION,
    MMLU_TASKS, TAGS, WIKITEXT_TEST, run_lm_eval_reference, write_fixture_tasks,
)

MMLU_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mmlu"
FEWSHOT_SEED = 1234  # simple_evaluate's default fewshot_random_seed


@pytest.fixture(scope="module")
def include_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture_tasks(tmp_path_factory.mktemp("lm-eval-fixtures"), MMLU_DIR if MMLU_DIR.is_dir() else None)


def test_fixture_files_are_deterministic(tmp_path: Path):
    first, second = write_fixture_tasks(tmp_path / "a"), write_fixture_tasks(tmp_path / "b")
    files = sorted(p.relative_to(first.parent) for p in first.parent.rglob("*") if p.is_file())
    assert len(files) == 21  # 10 data files, 8 YAMLs, 3 !function modules
    for rel in files:
        text = (first.parent / rel).read_text().replace(str(first.parent), "ROOT")
        assert text == (second.parent / rel).read_text().replace(str(second.parent), "ROOT"), rel


def test_tasks_groups_and_tags_resolve(include_path: Path):
    # with lm-eval's packaged tasks (no name clashes); their index from evalrun's cache, which
    # tests/test_lm_eval_index.py holds equal to lm-eval's own TaskManager over the same folders
    manager = task_manager(str(include_path))
    has_mmlu = MMLU_DIR.is_dir()
    tasks = {**FIXTURE_TASKS, **(MMLU_TASKS if has_mmlu else {})}
    groups = [group for group in GROUPS if has_mmlu or group != "mmlu_local"]
    for name in [*tasks, *groups]:
        assert include_path in manager.task_index[name].yaml_path.parents, name
    assert set(groups) <= set(manager.all_groups) and set(TAGS) <= set(manager.all_tags)
    for tag, members in TAGS.items():
        assert sorted(manager.task_index[tag].tags) == sorted(members)

    loaded = manager.load([*groups, *TAGS])
    assert sorted(loaded["tasks"]) == sorted(tasks)
    assert loaded["group_map"]["tiny_suite"] == list(GROUPS["tiny_suite"])
    for name, task in loaded["tasks"].items():
        assert task.OUTPUT_TYPE == tasks[name].output_type
        assert tasks[name].num_docs in (None, len(task.eval_docs))


def _arc_answer(row: tuple) -> str:
    return row[2][row[4]]


def _preprocess(text: str) -> str:
    """lm_eval/tasks/hellaswag/utils.py's preprocess."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag_shot(row: tuple) -> tuple[str, str]:
    activity, ctx_a, ctx_b, endings, label, _ = row
    return _preprocess(f"{activity}: {ctx_a} {ctx_b.capitalize()}"), _preprocess(endings[int(label)])


def test_reference_multiple_choice_group(tiny_model_dir: Path, include_path: Path):
    num_fewshot, limit = 2, 4
    ref = run_lm_eval_reference(tiny_model_dir, ["tiny_suite"], include_path, num_fewshot=num_fewshot, limit=limit)

    rnd = random.Random(FEWSHOT_SEED)  # fewshot_split train != test_split test: n docs per draw
    for sample, row in zip(ref["samples"]["arc_tiny"], ARC_TEST[:limit], strict=True):
        shots = rnd.sample(ARC_TRAIN, num_fewshot)
        context = "".join(f"Question: {s[1]}\nAnswer: {_arc_answer(s)}\n\n" for s in shots)
        context += f"Question: {row[1]}\nAnswer:"
        assert sample["arguments"] == [[context, f" {choice}"] for choice in row[2]]
        assert sample["target"] == row[4]
    rnd = random.Random(FEWSHOT_SEED)  # no fewshot_split, test_split null: n + 1 docs, the doc removed
    for sample, row in zip(ref["samples"]["hellaswag_tiny"], HELLASWAG_VALIDATION[:limit], strict=True):
        shots = rnd.sample(HELLASWAG_TRAIN, num_fewshot + 1)[:num_fewshot]
        context = "".join(f"{q} {a}\n\n" for q, a in map(_hellaswag_shot, shots)) + _hellaswag_shot(row)[0]
        assert sample["arguments"] == [[context, f" {_preprocess(e)}"] for e in row[3]]
        assert sample["target"] == int(row[4])

    for task in GROUPS["tiny_suite"]:
        samples = ref["samples"][task]
        assert [s["doc_id"] for s in samples] == list(range(limit))
        for sample in samples:
            assert {"acc", "acc_norm"} <= set(sample) and sample["filter"] == "none"
            lls = [ll for ll, _ in sample["filtered_resps"]]
            assert sample["acc"] == float(lls.index(max(lls)) == sample["target"])
        assert ref["results"][task]["acc,none"] == pytest.approx(sum(s["acc"] for s in samples) / limit)
        assert "acc_norm_stderr,none" in ref["results"][task]
    group_acc = sum(ref["results"][t]["acc,none"] for t in GROUPS["tiny_suite"]) / 2  # equal sizes
    assert ref["results"]["tiny_suite"]["acc,none"] == pytest.approx(group_acc)


def _regex_take_first(text: str, pattern: str, group_select: int) -> str:
    """lm-eval's "regex" filter (fallback "[invalid]") followed by "take_first"."""
    matches = re.findall(pattern, text)
    if not matches:
        return "[invalid]"
    match = matches[group_select]
    if isinstance(match, tuple):
        match = next((group for group in match if group), "[invalid]")
    return match.strip()


def test_reference_generate_until(tiny_model_dir: Path, include_path: Path):
    num_fewshot, limit = 2, 3
    ref = run_lm_eval_reference(tiny_model_dir, ["gsm8k_tiny"], include_path, num_fewshot=num_fewshot, limit=limit)
    samples = ref["samples"]["gsm8k_tiny"]
    assert [(s["doc_id"], s["filter"]) for s in samples] == [
        (i, f) for f in ("strict-match", "flexible-extract") for i in range(limit)
    ]
    patterns = {"strict-match": (r"#### (\-?[0-9\.\,]+)", 0), "flexible-extract": (r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1)}
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in GSM8K_TRAIN[:num_fewshot])  # first_n
    for sample in samples:
        question, answer = GSM8K_TEST[sample["doc_id"]]
        assert sample["arguments"] == [[
            f"{shots}Question: {question}\nAnswer:",
            {"until": ["Question:", "</s>", "<|im_end|>"], "do_sample": False, "temperature": 0.0, "max_gen_toks": 32},
        ]]
        assert sample["target"] == answer
        (generated,) = sample["resps"][0]
        assert sample["filtered_resps"] == [_regex_take_first(generated, *patterns[sample["filter"]])]
        assert sample["exact_match"] in (0.0, 1.0)
    for name in patterns:
        assert {f"exact_match,{name}", f"exact_match_stderr,{name}"} <= set(ref["results"]["gsm8k_tiny"])


def test_reference_loglikelihood_rolling(tiny_model_dir: Path, include_path: Path):
    ref = run_lm_eval_reference(tiny_model_dir, ["wikitext_tiny"], include_path, num_fewshot=0)
    samples = ref["samples"]["wikitext_tiny"]
    assert len(samples) == len(WIKITEXT_TEST)
    for sample, page in zip(samples, WIKITEXT_TEST, strict=True):
        assert sample["arguments"] == [[sample["target"]]] and " @-@ " not in sample["target"]  # detokenized
        (ll,) = sample["filtered_resps"]
        words, num_bytes = len(re.split(r"\s+", page)), len(page.encode("utf-8"))  # the raw page's counts
        assert sample["word_perplexity"] == [ll, words] and sample["bits_per_byte"] == [ll, num_bytes]
    results = ref["results"]["wikitext_tiny"]
    total_ll = sum(s["filtered_resps"][0] for s in samples)
    total_words = sum(s["word_perplexity"][1] for s in samples)
    total_bytes = sum(s["byte_perplexity"][1] for s in samples)
    assert results["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / total_words))
    assert results["byte_perplexity,none"] == pytest.approx(math.exp(-total_ll / total_bytes))
    assert results["bits_per_byte,none"] == pytest.approx(-total_ll / total_bytes / math.log(2))
    assert results["word_perplexity_stderr,none"] == "N/A"  # no stderr for weighted perplexities


def _mmlu_question(row: dict) -> str:
    options = "".join(f"\n{letter}. {choice}" for letter, choice in zip("ABCD", row["choices"], strict=True))
    return f"{row['question'].strip()}{options}\nAnswer:"


@pytest.mark.skipif(not MMLU_DIR.is_dir(), reason=f"no local MMLU copy at {MMLU_DIR}")
def test_reference_mmlu_local(tiny_model_dir: Path, include_path: Path):
    import pyarrow.parquet as pq

    limit = 2
    ref = run_lm_eval_reference(tiny_model_dir, ["mmlu_local"], include_path, num_fewshot=5, limit=limit)
    dev, test = (pq.read_table(MMLU_DIR / f"{split}.parquet").to_pylist() for split in ("dev", "test"))
    for task in MMLU_TASKS:
        subject = task.removeprefix("mmlu_local_")
        shots = [row for row in dev if row["subject"] == subject][:5]
        rows = [row for row in test if row["subject"] == subject][:limit]
        prefix = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        prefix += "".join(f"{_mmlu_question(s)} {'ABCD'[s['answer']]}\n\n" for s in shots)
        samples = ref["samples"][task]
        for sample, row in zip(samples, rows, strict=True):
            assert sample["arguments"] == [[prefix + _mmlu_question(row), f" {letter}"] for letter in "ABCD"]
            assert sample["target"] == row["answer"] and "acc" in sample
        assert ref["results"][task]["acc,none"] == pytest.approx(sum(s["acc"] for s in samples) / limit)
    assert "acc,none" in ref["results"]["mmlu_local"]
