"""Reading Hugging Face safetensors checkpoints (single file or sharded index)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open


class WeightsError(ValueError):
    """Weights missing or not matching the config."""


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return files
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json"
    )


class WeightReader:
    """Loads named tensors on demand, keeping each shard open once."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.files = weight_files(model_dir)
        self.dtype = dtype
        self.device = device
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.files:
            raise WeightsError(f"weights lack tensor {name!r} (checked {len(self.files)} tensors)")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        tensor = self._handles[path].get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise WeightsError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {tuple(shape)}")
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def names(self) -> Iterator[str]:
        return iter(self.files)
