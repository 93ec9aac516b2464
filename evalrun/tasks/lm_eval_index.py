"""lm-eval's TaskManager with its packaged tasks' index read from a cache (`evalrun task`).

lm-eval's `TaskManager()` parses every YAML of its packaged tasks (about 14,700 files, 13-19 s on
the CPUs we meet) before it resolves a single name. The index it builds from them (lm-eval's
`TaskIndex.build`: name -> Entry) depends on those files alone, so it is pickled under
`$EVALRUN_CACHE/lm-eval-index/` (else `~/.cache/evalrun/...`), named by a key of lm-eval's version,
the tasks folder and every YAML's relative path, size and mtime (a stat walk, ~0.3 s): a YAML
changed, added or removed gives another key, so a stale index is never read. A manager is then
lm-eval's own over the `--include-path` folders alone, with those entries laid over the cached
packaged ones in the order `TaskManager(include_path=...)` gives them (packaged first; a name an
include path defines again is the include path's, with lm-eval's warning).

The pickle is trusted as the compiled kernels in the same cache are (the user's own folder). An
unreadable or foreign file is rebuilt; a cache that cannot be written is skipped. The three newest
indexes are kept. EVALRUN_LM_EVAL_INDEX=0 builds the index as lm-eval does, every time.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional

from ..engine.dtype_probe import cache_root

log = logging.getLogger(__name__)
KEEP = 3                                     # newest cached indexes kept (one per lm-eval install)
_IGNORED_DIRS = {"__pycache__", ".ipynb_checkpoints"}      # as lm-eval's TaskIndex walks
_MANAGER_FIELDS = ("_index", "_all_tasks", "_all_subtasks", "_all_groups", "_all_tags")


def enabled() -> bool:
    return os.environ.get("EVALRUN_LM_EVAL_INDEX", "1").strip() != "0"


def packaged_root() -> Path:
    """The folder of lm-eval's packaged task YAMLs."""
    import lm_eval.tasks
    return Path(lm_eval.tasks.__file__).resolve().parent


def index_key(root: Path) -> str:
    """A key of lm-eval's version, `root` and every YAML under it (relative path, size, mtime)."""
    from lm_eval import __version__
    h = hashlib.sha256(f"lm-eval {__version__}\0{root.resolve()}\0".encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _IGNORED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".yaml"):
                path = os.path.join(dirpath, name)
                st = os.stat(path)
                h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def packaged_index(root: Optional[Path] = None) -> dict[str, Any]:
    """lm-eval's `TaskIndex.build([root])` (root: its packaged tasks), from the cache when it holds it."""
    from lm_eval.tasks._index import TaskIndex
    root = packaged_root() if root is None else Path(root)
    if not enabled():
        return TaskIndex.build([root])
    folder = cache_root() / "lm-eval-index"
    path = folder / f"{index_key(root)}.pickle"
    try:
        with path.open("rb") as f:
            index = pickle.load(f)
        if isinstance(index, dict):
            os.utime(path)                   # the newest use, for KEEP
            return index
        log.info("ignoring %s: not an index", path)
    except FileNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file is rebuilt, never fatal
        log.info("ignoring the unreadable cached index %s: %s", path, exc)
    index = TaskIndex.build([root])
    _store(folder, path, index)
    return index


def _store(folder: Path, path: Path, index: dict[str, Any]) -> None:
    """Writes `index` to `path` atomically; keeps the KEEP newest indexes of the folder."""
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".index-", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(index, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        tmp = None
        stale = sorted(folder.glob("*.pickle"), key=lambda p: p.stat().st_mtime, reverse=True)[KEEP:]
        for old in stale:
            old.unlink(missing_ok=True)
    except OSError as exc:
        log.info("lm-eval's task index is not cached (%s): the next run builds it again", exc)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def task_manager(include_path: Optional[str], packaged: bool = True, root: Optional[Path] = None) -> Any:
    """`lm_eval.tasks.TaskManager(include_path=include_path, include_defaults=packaged)`, the packaged
    tasks' index (those under `root`, default lm-eval's) read through the cache."""
    return cached_manager_class()(include_path=include_path, include_defaults=packaged, packaged_root=root)


@functools.lru_cache(maxsize=None)
def cached_manager_class() -> type:
    """lm-eval's TaskManager, its packaged index read through the cache (a subclass, built on first use:
    lm-eval is an optional extra)."""
    from lm_eval.tasks import TaskManager

    class CachedTaskManager(TaskManager):
        """TaskManager whose packaged tasks' index comes from packaged_index (evalrun/tasks/lm_eval_index.py)."""

        def __init__(self, verbosity: Optional[str] = None, include_path: Any = None, include_defaults: bool = True,
                     metadata: Optional[dict] = None, packaged_root: Optional[Path] = None):
            def lm_evals_own_build() -> None:         # the packaged folder parsed with the include paths
                roots = [packaged_root] if packaged_root is not None else []
                more = list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]
                paths = roots + [p for p in more if p]
                super(CachedTaskManager, self).__init__(verbosity, paths or None, include_defaults=packaged_root is None,
                                                        metadata=metadata)

            if include_defaults and not enabled():
                lm_evals_own_build()
                return
            super().__init__(verbosity, include_path, include_defaults=False, metadata=metadata)
            if not include_defaults:
                return
            if not all(hasattr(self, field) for field in _MANAGER_FIELDS):
                lm_evals_own_build()                  # not laid out as lm-eval 0.4.13's (pinned): its own way
                return
            index = dict(packaged_index(packaged_root))
            for name, entry in self._index.items():
                if name in index:             # lm-eval's warning (TaskIndex.build) for a redefined name
                    logging.getLogger("lm_eval.tasks._index").warning(
                        "Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                        index[name].yaml_path)
                index[name] = entry
            _set_index(self, index)

    return CachedTaskManager


@contextlib.contextmanager
def lm_eval_uses_the_cache() -> Iterator[None]:
    """Within it, lm-eval's own code (its CLI: `lm_eval.tasks.TaskManager` looked up when it runs)
    builds managers whose packaged index comes from the cache."""
    import lm_eval.tasks
    real = lm_eval.tasks.TaskManager
    lm_eval.tasks.TaskManager = cached_manager_class()
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = real


def _set_index(manager: Any, index: dict[str, Any]) -> None:
    """The manager's index and name lists, as TaskManager.__init__ derives them (lm-eval 0.4.13)."""
    from lm_eval.tasks._index import Kind
    buckets: dict[Any, list[str]] = defaultdict(list)
    for name, entry in index.items():
        buckets[entry.kind].append(name)
    manager._index = index
    manager._all_tasks = sorted(index)
    manager._all_subtasks = sorted(buckets[Kind.TASK] + buckets[Kind.PY_TASK])
    manager._all_groups = sorted(buckets[Kind.GROUP])
    manager._all_tags = sorted(buckets[Kind.TAG])
