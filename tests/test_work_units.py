"""Work units (evalrun/scale/units.py) and shard selection (evalrun/scale/shard.py), without a model: exact
chunks and assignments on hand-made prefix groups, determinism, every document in exactly one
shard, prefix groups kept whole unless the chunking rule cuts them, and the balance bound
(heaviest shard - lightest shard <= largest unit) on MMLU-shaped and HumanEval-shaped work."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from evalrun.errors import BadInput
from evalrun.scale.shard import ShardSpec, parse_shard, take_shard
from evalrun.scale.units import UNITS_PER_SHARD, WorkUnit, assign_shards, shard_units, units_digest, work_units
from evalrun.tasks.base import PrefixGroup, estimate_tokens
from evalrun.tasks.humaneval import HumanEvalSettings, HumanEvalTask
from evalrun.tasks.humaneval_data import load_humaneval
from evalrun.tasks.mmlu import MMLUTask, prompt_prefix

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"


def _group(key: str, n_docs: int, shared: int, own: int = 10, divisible: bool = True) -> PrefixGroup:
    return PrefixGroup(key, tuple((key, i) for i in range(n_docs)), shared, (own,) * n_docs, divisible)


def _unit(key: str, est: int) -> WorkUnit:
    return WorkUnit(key, key, ((key, 0),), est)


def _loads(shards: list[list[WorkUnit]]) -> list[int]:
    return [sum(u.est_tokens for u in s) for s in shards]


def _mmlu_shaped(seed: int = 0) -> list[PrefixGroup]:
    """57 subjects of 100-1534 questions (MMLU's range), 5-shot prefixes of 400-900 tokens."""
    rng = random.Random(seed)
    sizes = [1534, 100] + [rng.randint(100, 400) for _ in range(55)]
    return [PrefixGroup(f"subject_{i:02d}", tuple((f"subject_{i:02d}", j) for j in range(n)), rng.randint(400, 900),
                        tuple(rng.randint(40, 400) for _ in range(n)), divisible=True) for i, n in enumerate(sizes)]


def test_estimate_is_characters_over_four_rounded_up():
    assert [estimate_tokens("x" * n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_groups_stay_whole_without_a_cap_or_when_not_divisible():
    groups = [_group("a", 5, 100), _group("b", 50, 100, divisible=False)]
    assert [(u.key, len(u.doc_keys), u.est_tokens) for u in work_units(groups)] == [("a", 5, 150), ("b", 50, 600)]
    assert [u.key for u in work_units(groups, max_unit_tokens=10)] == ["a", "b"]       # a: own 50 < 2 x shared


def test_a_divisible_group_is_cut_into_consecutive_chunks():
    # est 20 + 100 > 55: a chunk has room for 35 own tokens -> ceil(100 / 35) = 3 chunks, cut where the
    # running sum of the documents' 10 tokens first reaches 34 and 67
    units = work_units([_group("law", 10, 20)], max_unit_tokens=55)
    assert [u.key for u in units] == ["law#0", "law#1", "law#2"]
    assert [[k[1] for k in u.doc_keys] for u in units] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [u.est_tokens for u in units] == [60, 50, 50]                # each chunk repeats the 20-token prefix
    uneven = PrefixGroup("u", tuple(("u", i) for i in range(6)), 1, (50, 1, 1, 1, 1, 46), divisible=True)
    assert [len(u.doc_keys) for u in work_units([uneven], max_unit_tokens=60)] == [1, 5]   # cut by tokens
    assert {u.group for u in units} == {"law"}
    # a chunk must carry at least as many tokens of its own as the prefix it repeats: 100 // 40 = 2 chunks
    assert [u.key for u in work_units([_group("law", 10, 40)], max_unit_tokens=10)] == ["law#0", "law#1"]


def test_bad_groups_and_caps_are_refused():
    with pytest.raises(ValueError, match="share the key 'a'"):
        work_units([_group("a", 1, 1), _group("a", 1, 1)])
    with pytest.raises(ValueError, match="max_unit_tokens must be >= 1"):
        work_units([_group("a", 1, 1)], max_unit_tokens=0)
    with pytest.raises(ValueError, match="one token estimate per document"):
        PrefixGroup("a", (("a", 0),), 1, ())
    with pytest.raises(ValueError, match="at least one shard"):
        assign_shards([], 0)


def test_lpt_assignment_is_exact_and_ties_go_by_key_then_shard():
    units = [_unit(k, est) for k, est in [("a", 2), ("b", 7), ("c", 4), ("d", 6), ("e", 3), ("f", 5)]]
    shards = assign_shards(units, 2)
    # 7 -> 0; 6 -> 1; 5 -> 1 (11); 4 -> 0 (11); 3 -> 0 (a tie: the lower shard, 14); 2 -> 1 (13)
    assert [[u.key for u in s] for s in shards] == [["b", "c", "e"], ["a", "d", "f"]]     # each in task order
    assert _loads(shards) == [14, 13]
    tied = assign_shards([_unit("y", 5), _unit("x", 5), _unit("z", 5)], 2)
    assert [[u.key for u in s] for s in tied] == [["x", "z"], ["y"]]                     # x before y: by key


def test_assignment_is_deterministic_and_independent_of_input_order():
    units = work_units(_mmlu_shaped(), max_unit_tokens=50_000)
    shuffled = units[:]
    random.Random(1).shuffle(shuffled)
    for n in (1, 3, 16):
        by_key = [sorted(u.key for u in s) for s in assign_shards(units, n)]
        assert by_key == [sorted(u.key for u in s) for s in assign_shards(shuffled, n)]
        assert by_key == [sorted(u.key for u in s) for s in assign_shards(list(units), n)]


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16, 64])
def test_mmlu_shaped_shards_are_balanced_and_cover_every_doc_once(n):
    groups = _mmlu_shaped()
    total = sum(g.est_tokens for g in groups)
    units = work_units(groups, max(1, -(-total // (UNITS_PER_SHARD * n))))
    shards = assign_shards(units, n)
    docs = [k for s in shards for u in s for k in u.doc_keys]
    assert sorted(docs) == sorted(k for g in groups for k in g.doc_keys) and len(docs) == len(set(docs))
    loads = _loads(shards)
    biggest = max(u.est_tokens for u in units)
    assert max(loads) - min(loads) <= biggest                          # the LPT bound (units.assign_shards)
    assert biggest <= total / (UNITS_PER_SHARD * n) + 400              # the cap, plus at most one question
    assert max(loads) <= 1.25 * total / n + 400                        # so: within 25% of a fair share
    for group in groups:                                               # a group is cut only into its own chunks
        parts = [u for u in units if u.group == group.key]
        assert [k for u in parts for k in u.doc_keys] == list(group.doc_keys)
        assert len(parts) == 1 or all(u.key.startswith(group.key + "#") for u in parts)


def test_humaneval_problems_are_never_cut():
    data = load_humaneval()
    task = HumanEvalTask(data, HumanEvalSettings(n_samples=20, max_new_tokens=64))
    for n in (3, 50, 164):
        units = shard_units(task, n)
        assert [u.key for u in units] == [p.task_id for p in data.problems]
        assert all(len(u.doc_keys) == 20 and {k[0] for k in u.doc_keys} == {u.key} for u in units)
        loads = _loads(assign_shards(units, n))
        assert max(loads) - min(loads) <= max(u.est_tokens for u in units)
    first = data.problems[0]
    assert units[0].est_tokens == estimate_tokens(first.prompt) + 20 * 64


def test_mmlu_groups_are_subjects_with_model_free_estimates():
    task = MMLUTask(str(FIXTURE), num_fewshot=5)
    groups = task.prefix_groups()
    assert [g.key for g in groups] == task.subjects
    assert [k for g in groups for k in g.doc_keys] == task.doc_keys()
    philosophy = next(g for g in groups if g.key == "philosophy")
    assert philosophy.shared_tokens == estimate_tokens(prompt_prefix("philosophy", task.data.dev["philosophy"]))
    assert shard_units(task, 3) == shard_units(MMLUTask(str(FIXTURE), num_fewshot=5), 3)   # same on every run


@pytest.mark.parametrize("text,spec", [("0/1", (0, 1)), ("2/3", (2, 3)), ("10/16", (10, 16))])
def test_parse_shard_accepts_k_of_n(text, spec):
    parsed = parse_shard(text)
    assert parsed is not None and (parsed.index, parsed.count) == spec and parsed.label == text


@pytest.mark.parametrize("text", ["3/3", "1/0", "0/0", "-1/2", "a/b", "1", "1/2/3", " 1/2", "1.0/2", ""])
def test_parse_shard_refuses_everything_else_naming_the_flag(text):
    with pytest.raises(BadInput, match="--shard"):
        parse_shard(text)


def test_the_shards_of_a_task_partition_it_and_share_one_selection():
    task = MMLUTask(str(FIXTURE), num_fewshot=0)
    shards = [take_shard(task, ShardSpec(k, 3)) for k in range(3)]
    keys = [k for s in shards for k in s.task.doc_keys()]
    assert sorted(keys) == sorted(task.doc_keys()) and len(keys) == len(set(keys))
    assert len({s.selection["sha256"] for s in shards}) == 1
    assert shards[0].selection["groups"] == task.subjects
    for s in shards:
        assert s.task.doc_keys() == [k for u in s.units for k in u.doc_keys]
        assert s.task.subjects == [x for x in task.subjects if any(k[0] == x for k in s.task.doc_keys())]
        assert s.identity() == {"shard": s.spec.label, "shard_selection": s.selection["sha256"][:16]}
        assert s.record()["docs"] == len(s.task.doc_keys())
    narrower = take_shard(MMLUTask(str(FIXTURE), num_fewshot=0, limit=4), ShardSpec(0, 3))
    assert narrower.selection["sha256"] != shards[0].selection["sha256"]
    assert units_digest(shard_units(task, 3)) == shards[0].selection["sha256"]


def test_a_restricted_humaneval_task_plans_only_its_samples(tiny_model_dir):
    from evalrun.engine import Tokenizer
    task = HumanEvalTask(load_humaneval(), HumanEvalSettings(n_samples=3, limit=4))
    keys = [("HumanEval/2", 1), ("HumanEval/0", 0), ("HumanEval/0", 2), ("HumanEval/9", 0)]    # /9 is past --limit
    small = task.restricted(keys)
    assert small.doc_keys() == [("HumanEval/0", 0), ("HumanEval/0", 2), ("HumanEval/2", 1)]
    plans = list(small.plan(Tokenizer.load(tiny_model_dir), 4096))
    assert [p.doc_key for p in plans] == small.doc_keys()
    assert [g.key for g in small.prefix_groups()] == ["HumanEval/0", "HumanEval/2"]
