"""Reading Hugging Face safetensors checkpoints (single file or sharded index).

Tensors are read one at a time as the model is built. On CUDA each shard is opened with
safetensors' device argument, so a tensor goes from the file's mapping straight into device
memory: no CPU copy of the weights is made, whole or per tensor."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open


class WeightsError(ValueError):
    """Weights missing or not matching the config."""


def weight_files(model_dir: Path, device: str = "cpu") -> dict[str, Path]:
    """Map every tensor name to the file that holds it (a single file's names read through an open
    on `device`, the one its tensors will be read on: nothing is loaded)."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return files
    if single.is_file():
        with _open(single, device) as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json"
    )


def _open(path: Path, device: str = "cpu"):
    """safe_open, with a truncated or corrupt file named in a WeightsError."""
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError) as exc:
        raise WeightsError(f"{path}: not a readable safetensors file ({exc}); it may be truncated or corrupt: "
                           "copy or download it again") from None


class WeightReader:
    """Loads named tensors on demand, keeping each shard open once."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.files = weight_files(model_dir, self._open_device(device))
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
            self._handles[path] = _open(path, self._open_device(self.device))
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
