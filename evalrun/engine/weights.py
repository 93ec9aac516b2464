"""Reading Hugging Face safetensors checkpoints (single file or sharded index).

Tensors are read one at a time as the model is built. On CUDA each shard is opened with
safetensors' device argument, so a tensor goes from the file's mapping straight into device
memory: no CPU copy of the weights is made, whole or per tensor.

The files are a model directory's, read as engine/model_files.py reads them: the index and every
shard must be regular files inside the directory (an index's shard name is a plain relative name;
a link is refused, the hub cache's own links into its blobs/ excepted)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from .model_files import check_model_file, inside, read_json_object

MAX_INDEX_BYTES = 64 << 20         # an index is ~100 bytes per tensor: a few MiB for the largest models


class WeightsError(ValueError):
    """Weights missing or not matching the config."""


def weight_files(model_dir: Path, device: str = "cpu") -> dict[str, Path]:
    """Map every tensor name to the file that holds it (a single file's names read through an open
    on `device`, the one its tensors will be read on: nothing is loaded)."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if os.path.lexists(index):
        weight_map = read_json_object(model_dir, index, WeightsError, MAX_INDEX_BYTES).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index}: not a safetensors index (its weight_map is not an object)")
        files = {name: inside(model_dir, fname, WeightsError, str(index)) for name, fname in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not os.path.lexists(p)})
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are missing: {', '.join(missing)}")
        for path in set(files.values()):
            check_model_file(model_dir, path, WeightsError)
        return files
    if os.path.lexists(single):
        with _open(model_dir, single, device) as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json"
    )


def _open(model_dir: Path, path: Path, device: str = "cpu"):
    """safe_open of the checked real path of `path` (check_model_file), with a truncated or corrupt
    file named in a WeightsError."""
    real = check_model_file(model_dir, path, WeightsError)
    try:
        return safe_open(str(real), framework="pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise WeightsError(f"{path}: not a readable safetensors file ({exc}); it may be truncated or corrupt: "
                           "copy or download it again") from None


class WeightReader:
    """Loads named tensors on demand, keeping each shard open once."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.model_dir = Path(model_dir)
        self.files = weight_files(self.model_dir, self._open_device(device))
        self.dtype = dtype
        self.device = device
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _open_device(device: torch.device) -> str:
        return str(device) if device.type == "cuda" else "cpu"

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.files:
            raise WeightsError(f"weights lack tensor {name!r} (checked {len(self.files)} tensors)")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = _open(self.model_dir, path, self._open_device(self.device))
        try:
            tensor = self._handles[path].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise WeightsError(f"{path}: tensor {name!r} cannot be read ({exc}); the file may be truncated or "
                               "corrupt: copy or download it again") from None
        if tuple(tensor.shape) != tuple(shape):
            raise WeightsError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {tuple(shape)}")
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def names(self) -> Iterator[str]:
        return iter(self.files)
