"""Reading files from an untrusted model directory, with O_NOFOLLOW semantics.

Every file evalrun reads from a model (config.json, generation_config.json, tokenizer.json,
tokenizer_config.json, the safetensors files and their index, a .gguf file, the chat templates) is
checked here first. A file is refused, with one line naming it, when

- it is a symbolic link: a model directory's files must be its own regular files. One exception
  keeps Hugging Face hub downloads working: in a hub cache snapshot
  (`.../models--ORG--NAME/snapshots/REV/`) every file is a link into that repo's `blobs/` folder,
  so a link that resolves to a regular file in the same repo's `blobs/` is accepted;
- it resolves outside the (resolved) model directory (a linked sub-folder, `..` in a name);
- it is not a regular file (a FIFO would block the open, a device would never end);
- it is larger than the bound its caller gives (read_model_file).

What is read is what was checked: the file is opened by its resolved path with O_NOFOLLOW and
O_NONBLOCK and checked again with fstat. The error class is the caller's (ConfigError,
WeightsError, TokenizerError, ChatTemplateError), so each is reported as that part's bad input.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Optional

MAX_JSON_BYTES = 16 << 20        # config.json is a few KiB; the largest tokenizer_config.json seen ~1.2 MiB


def check_model_file(model_dir: Path, path: Path, error: type[Exception], label: str = "model file") -> Path:
    """The real path of `path`, a file of `model_dir`; `error` ("{label} {path}: refused: ...") when it
    is a symbolic link (a hub-cache snapshot's link into its own repo's blobs/ excepted), resolves
    outside the directory, or is not a regular file."""
    try:
        base, real = Path(model_dir).resolve(), Path(path).resolve()
    except (OSError, RuntimeError) as exc:        # a link loop
        raise error(f"{label} {path}: refused: cannot be resolved ({_one_line(exc)})") from None
    blobs = hub_blobs(base)
    if blobs is not None and path.is_symlink() and real.is_relative_to(blobs):
        pass                            # the hub cache's own layout: snapshot file -> ../../blobs/<hash>
    elif path.is_symlink():
        raise error(f"{label} {path}: refused: it is a symbolic link (to {os.readlink(path)}); a model's files "
                    "must be regular files inside the model directory (copy the file there)")
    elif not real.is_relative_to(base):
        raise error(f"{label} {path}: refused: it resolves to {real}, outside the model directory {base}")
    if not real.is_file():
        raise error(f"{label} {path}: refused: not a regular file")
    return real


def hub_blobs(base: Path) -> Optional[Path]:
    """The `blobs/` folder of the hub-cache repo whose snapshot `base` is (None: not a snapshot)."""
    # .../models--ORG--NAME/snapshots/REV -> .../models--ORG--NAME/blobs
    snapshots, repo = base.parent, base.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--"):
        return repo / "blobs"
    return None


def inside(model_dir: Path, name: Any, error: type[Exception], what: str) -> Path:
    """model_dir / name for a file name that a model's own file gives (a safetensors index's shard):
    a relative name without `..`, else `error` naming `what`."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts \
            or "\0" in name:
        raise error(f"{what}: refused: {name!r} is not a file name inside the model directory")
    return Path(model_dir) / name


def read_model_file(model_dir: Path, path: Path, error: type[Exception], max_bytes: int,
                    label: str = "model file") -> bytes:
    """The bytes of `path` (checked by check_model_file), at most `max_bytes` of them (else `error`)."""
    real = check_model_file(model_dir, path, error, label)
    # NOTE: O_NOFOLLOW on the resolved path and fstat after open: what is read is what was checked.
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{label} {path}: cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise error(f"{label} {path}: refused: not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{label} {path}: refused: larger than {max_bytes} bytes")
    return data


def read_json_object(model_dir: Path, path: Path, error: type[Exception],
                     max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON file of the model that must hold one object: `error` naming it when it cannot be read,
    is not UTF-8 JSON (NaN and Infinity included: not JSON; nesting deeper than Python's recursion
    limit included) or is not an object."""
    data = read_model_file(model_dir, path, error, max_bytes)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise error(f"{path} is not valid JSON: {_one_line(exc)}") from None
    if not isinstance(value, dict):
        raise error(f"{path}: must hold a JSON object, not {type(value).__name__}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
