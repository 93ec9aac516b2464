"""manifest.json helpers: model fingerprints, environment, throughput, identity comparison."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from evalrun.results.atomic import atomic_write_json
from evalrun.results.checksums import sha256_file
from evalrun.results.links import read_bytes_nofollow
from evalrun.results.schema import MANIFEST_FILE, ModelFingerprint, Throughput
from evalrun.version import git_info

MODEL_FILES = ("config.json",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
SAMPLE_BYTES = 1 << 20  # head and tail sampled from each weight file
PACKAGES = ("evalrun", "torch", "transformers", "tokenizers", "pandas", "pyarrow", "numpy")


TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"     # every timestamp in a run directory, e.g. 2026-11-30T17:51:09Z


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime(TIME_FORMAT)


def _sample_sha256(path: Path) -> str:
    """Hash of size + first 1 MiB + last 1 MiB: fast on multi-GB files.

    NOTE: an edit confined to the middle of a large file is not detected.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _weight_entry(path: Path) -> dict[str, Any]:
    return {"name": path.name, "size": path.stat().st_size, "sample_sha256": _sample_sha256(path)}


def fingerprint_model_dir(path: str | Path) -> ModelFingerprint:
    """Content fingerprints of a model dir (or of a single weights file, e.g. a GGUF).

    Config and tokenizer files and any `*.index.json` are hashed in full; each weight file
    contributes its name, size and a head+tail sample hash. No mtimes, no absolute paths in
    the fingerprints, so a copied model fingerprints the same.
    """
    path = Path(path).resolve()
    if path.is_file():
        weights = [_weight_entry(path)]
        files: dict[str, Optional[str]] = {}
        index = None
    else:
        files = {
            name: (sha256_file(path / name) if (path / name).is_file() else None)
            for name in MODEL_FILES + TOKENIZER_FILES
        }
        indexes = sorted(path.glob("*.index.json"))
        index = {"name": indexes[0].name, "sha256": sha256_file(indexes[0])} if indexes else None
        weights = [
            _weight_entry(p) for p in sorted(path.iterdir()) if p.is_file() and p.suffix in WEIGHT_SUFFIXES
        ]
    model_part = {"config": files.get("config.json"), "index": index, "weights": weights}
    tokenizer_part = {name: files.get(name) for name in TOKENIZER_FILES}
    return {
        "path": str(path),
        "files": files,
        "weights_index": index,
        "weights": weights,
        "model_fingerprint": _digest(model_part),
        "tokenizer_fingerprint": _digest(tokenizer_part),
    }


def environment_info() -> dict[str, Any]:
    """Python version, versions of the installed packages that matter, and evalrun's git sha."""
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    return {"python": platform.python_version(), "platform": platform.platform(), "packages": packages,
            "git": git_info()}


def throughput(
    prompt_tokens: int, prefill_tokens_computed: int, wall_seconds: float, generated_tokens: int = 0
) -> Throughput:
    """Throughput fields for manifest["throughput"]; ratios are None when undefined."""
    per_s = (lambda n: n / wall_seconds) if wall_seconds > 0 else (lambda n: None)
    return {
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": prefill_tokens_computed,
        "generated_tokens": generated_tokens,
        "dedup_ratio": prompt_tokens / prefill_tokens_computed if prefill_tokens_computed else None,
        "wall_seconds": wall_seconds,
        "tokens_per_s": per_s(prompt_tokens + generated_tokens),
        "prefill_tokens_per_s": per_s(prefill_tokens_computed),
    }


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """manifest.json as stored (a link there is a RunDirLinkError: never followed)."""
    return json.loads(read_bytes_nofollow(Path(run_dir) / MANIFEST_FILE).decode("utf-8"))


def write_manifest(run_dir: str | Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(Path(run_dir) / MANIFEST_FILE, manifest)


_MISSING = "<missing>"

# How a differing identity field is named to the user; other fields are named by their key.
_FIELD_WORDS = {
    "model_fingerprint": "the model (its config or weights)",
    "tokenizer_fingerprint": "the tokenizer files",
    "data_fingerprint": "the data content",
    "prompt_format": "the prompt format",
    "task": "the task",
    "shard": "the shard (--shard)",
    "shard_selection": "the sharded selection (--subjects, --limit, --n-samples)",
}


def identity_mismatches(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One phrase per differing field, in words, e.g. "dtype differs (stored bfloat16, now float32)"."""
    lines = []
    for name in list(stored) + [k for k in current if k not in stored]:
        old, new = stored.get(name, _MISSING), current.get(name, _MISSING)
        if old == new:
            continue
        if name in _FIELD_WORDS:
            lines.append(f"{_FIELD_WORDS[name]} differs ({name} {_short(old)} stored, {_short(new)} now)")
        else:
            lines.append(f"{name} differs (stored {old!r}, now {new!r})")
    return lines


def _short(value: Any) -> str:
    return f"{value[:12]}..." if isinstance(value, str) and len(value) > 16 else repr(value)
