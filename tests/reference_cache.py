"""One test run's memo of expensive reference results (lm-eval's HF backend), shared by its xdist workers.

Several test files compare against the same lm-eval run (the same tiny model, fixture tasks and
arguments), and each xdist worker builds its own copies of the model and fixtures in its own temp
directory. `cached(kind, args, paths, compute)` keys a result by the arguments and the content of
`paths` (the model directory, the include path, and any file an absolute path in their text names,
the fixture data), with each path's own location replaced by a placeholder, so a worker whose copy
is byte-for-byte the same reads the result another worker computed in this run. The store lives in
$EVALRUN_TEST_REFERENCE_CACHE (set per test run by conftest.py); without it nothing is kept.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

ENV = "EVALRUN_TEST_REFERENCE_CACHE"
_ABSOLUTE = re.compile(rb"(?<![\w.~-])(/[\w.+-]+(?:/[\w.+-]+)+)")


def _anchors(paths: Sequence[Path]) -> list[tuple[bytes, bytes]]:
    """(location, placeholder) for each path and its parent directory, longest location first."""
    pairs = {}
    for i, root in enumerate(Path(p).resolve() for p in paths):
        pairs.setdefault(str(root).encode(), f"<root{i}>".encode())
        pairs.setdefault(str(root.parent).encode(), f"<parent{i}>".encode())
    return sorted(pairs.items(), key=lambda kv: -len(kv[0]))


def _neutral(data: bytes, anchors: list[tuple[bytes, bytes]]) -> bytes:
    for location, placeholder in anchors:
        data = data.replace(location, placeholder)
    return data


def tree_key(paths: Sequence[Path]) -> str:
    """Digest of every file under `paths` (names relative to their path) and of the files their text
    names by absolute path, every path's (and its parent's) location replaced by a placeholder."""
    anchors = _anchors(paths)
    h = hashlib.sha256()
    seen: set[Path] = set()
    named: set[Path] = set()
    for root in (Path(p).resolve() for p in paths):
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file()
                                                    and "__pycache__" not in f.parts)
        for f in files:
            data = f.read_bytes()
            seen.add(f)
            h.update(_neutral(str(f).encode(), anchors) + b"\n")
            h.update(hashlib.sha256(_neutral(data, anchors)).digest())
            if f.suffix in (".yaml", ".yml", ".py", ".json", "") and len(data) < 1 << 20:
                named.update(Path(m.decode()) for m in _ABSOLUTE.findall(data))
    for f in sorted(named - seen):
        if f.is_file():
            h.update(b"named " + _neutral(str(f).encode(), anchors) + b"\n")
            h.update(hashlib.sha256(_neutral(f.read_bytes(), anchors)).digest())
    return h.hexdigest()


def cached(kind: str, args: Any, paths: Sequence[Path], compute: Callable[[], Any]) -> Any:
    """compute() (JSON-able), or the value an earlier call with the same key stored in this test run."""
    store = os.environ.get(ENV)
    if not store:
        return compute()
    key = hashlib.sha256(json.dumps([kind, args, tree_key(paths)], sort_keys=True, default=str).encode()).hexdigest()
    path = Path(store) / f"{kind}-{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # a worker computing this key: wait for its result
        if not path.is_file():
            value = compute()
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump(value, f)
            os.replace(tmp, path)
    return json.loads(path.read_text())
