"""The cached index of lm-eval's packaged tasks (evalrun/tasks/lm_eval_index.py): a manager built on it
equals lm-eval's own TaskManager over the same folders (every entry, name list and loaded task), with
an include path that redefines a packaged task and tag; the cache is read on the next run, rebuilt
when a YAML changes or the file is unreadable, and bypassed with EVALRUN_LM_EVAL_INDEX=0.

The "packaged" folder here is the fixture tasks (tests/lm_eval_fixtures.py), not lm-eval's 14,700
YAMLs: the index does not depend on which folder it is."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("sacrebleu", reason="lm-eval's TaskManager imports sacrebleu: install evalrun[lm-eval]")

from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.tasks._index import TaskIndex  # noqa: E402
from lm_eval_fixtures import write_fixture_tasks  # noqa: E402

from evalrun.tasks import lm_eval_index  # noqa: E402
from evalrun.tasks.lm_eval_index import packaged_index, task_manager  # noqa: E402

OVERRIDE = """task: arc_tiny
include: {arc}
description: "Redefined by the include path.\\n\\n"
"""
EXTRA = """task: extra_tiny
include: {arc}
tag: tiny_tag
"""


@pytest.fixture()
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EVALRUN_LM_EVAL_INDEX", raising=False)
    root = write_fixture_tasks(tmp_path / "packaged")
    include = tmp_path / "include"
    include.mkdir()
    arc = root / "arc_tiny" / "arc_tiny.yaml"
    (include / "arc_override.yaml").write_text(OVERRIDE.format(arc=arc))
    (include / "extra_tiny.yaml").write_text(EXTRA.format(arc=arc))
    return root, include


@pytest.fixture()
def builds(monkeypatch: pytest.MonkeyPatch) -> list[list[Path]]:
    """The path lists TaskIndex.build is called with (lm-eval's parse of the YAMLs)."""
    calls: list[list[Path]] = []
    real = TaskIndex.build

    def counted(paths, **kwargs):
        calls.append([Path(p) for p in paths])
        return real(paths, **kwargs)
    monkeypatch.setattr(TaskIndex, "build", staticmethod(counted))
    return calls


def _entries(manager) -> dict:
    return {name: (e.kind, e.yaml_path, sorted(e.tags), e.cfg) for name, e in manager.task_index.items()}


def _lists(manager) -> tuple:
    return manager.all_tasks, manager.all_subtasks, manager.all_groups, manager.all_tags


def test_a_cached_manager_equals_lm_evals_over_the_same_folders(folders, caplog):
    root, include = folders
    theirs = TaskManager(include_path=[str(root), str(include)], include_defaults=False)
    task_manager(str(include), root=root)                       # builds and stores the index
    index_log = logging.getLogger("lm_eval.tasks._index")
    index_log.addHandler(caplog.handler)        # directly: lm-eval's CLI (run by other tests) may stop propagation
    try:
        with caplog.at_level(logging.WARNING, logger="lm_eval.tasks._index"):
            ours = task_manager(str(include), root=root)        # reads it
    finally:
        index_log.removeHandler(caplog.handler)
    assert "Task 'arc_tiny' from" in caplog.text and "overrides existing task" in caplog.text
    assert _entries(ours) == _entries(theirs) and _lists(ours) == _lists(theirs)
    assert ours.task_index["arc_tiny"].yaml_path.parent == include            # the include path's
    assert sorted(ours.task_index["tiny_tag"].tags) == ["extra_tiny"]          # its tag entry replaces
    assert "gsm8k_tiny" in ours.all_subtasks and "tiny_suite" in ours.all_groups

    names = ["tiny_suite", "tiny_tag", "gsm8k_tiny"]
    a, b = ours.load(names), theirs.load(names)
    assert sorted(a["tasks"]) == sorted(b["tasks"]) == ["arc_tiny", "extra_tiny", "gsm8k_tiny", "hellaswag_tiny"]
    assert a["group_map"] == b["group_map"]
    for name, task in a["tasks"].items():
        other = b["tasks"][name]
        assert task.config.to_dict() == other.config.to_dict(), name
        assert list(task.eval_docs) == list(other.eval_docs), name
    assert a["tasks"]["arc_tiny"].config.description.startswith("Redefined")


def test_the_index_is_read_back_and_rebuilt_when_a_yaml_changes(folders, builds):
    root, _ = folders
    first = packaged_index(root)
    assert builds == [[root]]
    assert packaged_index(root).keys() == first.keys() and builds == [[root]]      # from the cache
    cached = list((lm_eval_index.cache_root() / "lm-eval-index").glob("*.pickle"))
    assert len(cached) == 1

    yaml = root / "gsm8k_tiny" / "gsm8k_tiny.yaml"
    yaml.write_text(yaml.read_text().replace("task: gsm8k_tiny", "task: gsm8k_renamed"))
    changed = packaged_index(root)
    assert len(builds) == 2 and "gsm8k_renamed" in changed and "gsm8k_tiny" not in changed
    assert packaged_index(root).keys() == changed.keys() and len(builds) == 2

    (root / "new_task.yaml").write_text((root / "arc_tiny" / "arc_tiny.yaml").read_text()
                                        .replace("task: arc_tiny", "task: arc_added"))
    assert "arc_added" in packaged_index(root) and len(builds) == 3


def test_an_unreadable_cache_is_rebuilt_and_the_switch_turns_it_off(folders, builds, monkeypatch):
    root, _ = folders
    packaged_index(root)
    [cached] = (lm_eval_index.cache_root() / "lm-eval-index").glob("*.pickle")
    cached.write_bytes(cached.read_bytes()[:100])                               # truncated
    assert "arc_tiny" in packaged_index(root) and len(builds) == 2
    assert "arc_tiny" in packaged_index(root) and len(builds) == 2              # rewritten whole

    monkeypatch.setenv("EVALRUN_LM_EVAL_INDEX", "0")
    cached.unlink()
    assert "arc_tiny" in packaged_index(root) and len(builds) == 3
    assert "arc_tiny" in packaged_index(root) and len(builds) == 4
    assert not cached.exists()
    include = folders[1]
    ours = task_manager(str(include), root=root)              # lm-eval's own build over both folders
    theirs = TaskManager(include_path=[str(root), str(include)], include_defaults=False)
    assert _entries(ours) == _entries(theirs) and _lists(ours) == _lists(theirs) and not cached.exists()


def test_only_the_newest_indexes_are_kept(folders, tmp_path):
    root, _ = folders
    folder = lm_eval_index.cache_root() / "lm-eval-index"
    for i in range(lm_eval_index.KEEP + 2):
        copy = tmp_path / f"copy{i}"
        copy.mkdir()
        (copy / "t.yaml").write_text(f"task: t{i}\ndataset_path: json\noutput_type: generate_until\n")
        assert f"t{i}" in packaged_index(copy)
    assert len(list(folder.glob("*.pickle"))) == lm_eval_index.KEEP
    assert not list(folder.glob("*.tmp"))


def test_lm_evals_own_code_builds_cached_managers_within_the_context(folders, builds):
    import lm_eval.tasks
    from evalrun.tasks.lm_eval_index import cached_manager_class, lm_eval_uses_the_cache
    root, include = folders
    real = lm_eval.tasks.TaskManager
    packaged_index(root)                                     # stored (lm-eval's own packaged root is not used here)
    with lm_eval_uses_the_cache():
        from lm_eval.tasks import TaskManager as looked_up   # as lm-eval's CLI looks it up when it runs
        assert looked_up is cached_manager_class() and issubclass(looked_up, real)
        manager = looked_up(include_path=str(include), metadata={"k": 1}, packaged_root=root)
    assert lm_eval.tasks.TaskManager is real
    assert builds == [[root], [include]]                     # the packaged folder parsed once, then read back
    theirs = real(include_path=[str(root), str(include)], include_defaults=False)
    assert _entries(manager) == _entries(theirs) and _lists(manager) == _lists(theirs)
