"""`EngineConfig`: the engine settings of one command, checked and resolved (no `auto` left)
before any model is loaded, from the `EngineRequest` the CLI made of the engine flags."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from evalrun.engine.auto import (AUTO, Choice, HostFacts, SettingError, choose_cache_mode, choose_deterministic,
                                 choose_device, choose_dtype, host_facts)
from evalrun.engine.cache import CACHE_MODES
from evalrun.kernels.linear import invariant_unavailable_reason, linear_backend
from evalrun.errors import BadInput


@dataclass(frozen=True)
class EngineRequest:
    """The engine flags as given: `auto` and None left for engine_config() to resolve."""
    device: str = AUTO
    dtype: str = AUTO
    cache_mode: str = AUTO
    cache_tokens: Optional[int] = None
    cache_memory: Optional[int] = None
    cache_window: Optional[int] = None
    deterministic: str = AUTO
    eager: bool = False
    page_size: int = 256
    max_batch_size: Optional[int] = None
    max_chunk_size: int = 2048
    draft_model: Optional[str] = None
    ngram_draft: bool = False
    num_draft_tokens: int = 4

    def for_mode(self, mode: str) -> "EngineRequest":
        """This request with another cache mode; --cache-window only where the mode has a window."""
        float_mode = mode in CACHE_MODES and not CACHE_MODES[mode].quantized
        return replace(self, cache_mode=mode, cache_window=None if float_mode else self.cache_window)


@dataclass(frozen=True)
class EngineConfig:
    device: str
    dtype: str
    cache_mode: str
    cache_tokens: Optional[int] = None           # KV cache size in tokens (default 65536) ...
    cache_memory: Optional[int] = None           # ... or in bytes (--cache-memory), not both
    page_size: int = 256
    max_batch_size: Optional[int] = None
    max_chunk_size: int = 2048
    cache_window: Optional[int] = None           # q8/q6/q4 recent-token window (None: the mode's)
    choices: dict[str, Choice] = field(default_factory=dict)    # how device/dtype/cache_mode were picked
    draft_model: Optional[str] = None            # speculative decoding: a draft model directory ...
    ngram_draft: bool = False                    # ... or n-gram lookup in each job's own tokens
    num_draft_tokens: int = 4
    deterministic: bool = False                  # batch-invariant linears (--deterministic; part of the identity)
    eager: bool = False                          # --eager: no CUDA graphs for decode steps

    def __post_init__(self) -> None:
        for name in ("cache_tokens", "cache_memory", "page_size", "max_chunk_size", "max_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BadInput(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.cache_tokens is not None and self.cache_memory is not None:
            raise BadInput("give the KV cache size as --cache-tokens or as --cache-memory, not both")
        if self.cache_window is not None and self.cache_window < 0:
            raise BadInput(f"--cache-window must be >= 0, got {self.cache_window}")
        if self.num_draft_tokens < 1:
            raise BadInput(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if self.draft_model is not None and self.ngram_draft:
            raise BadInput("give either --draft-model or --ngram-draft, not both")
        if self.cache_tokens is not None and self.cache_tokens < self.page_size:
            raise BadInput(f"--cache-tokens ({self.cache_tokens}) must be at least --page-size ({self.page_size})")

    @property
    def cuda_graphs(self) -> bool:
        """Decode steps replayed as CUDA graphs (evalrun/engine/cuda_graphs.py): on CUDA unless --eager."""
        return self.device.startswith("cuda") and not self.eager

    def load_settings(self) -> dict[str, Any]:
        """The keyword arguments of Model.load that this config decides: every field that changes the
        loaded model (a model loaded with other values cannot serve this config)."""
        return {"dtype": self.dtype, "device": self.device, "deterministic": self.deterministic,
                "cuda_graphs": self.cuda_graphs}

    def speculative_record(self) -> dict[str, Any]:
        """manifest["speculative"]: how (and whether) generation drafted tokens."""
        drafts = "model" if self.draft_model else "ngram" if self.ngram_draft else None
        out: dict[str, Any] = {"drafts": drafts}
        if drafts:
            out["num_draft_tokens"] = self.num_draft_tokens
        if self.draft_model:
            out["draft_model"] = str(Path(self.draft_model).resolve())
        return out

    def choices_record(self) -> dict[str, dict[str, Any]]:
        """manifest["engine_choices"]: {"dtype": {"requested": "auto", "value": "float32", "reason": ...}};
        an auto dtype picked from the dtype probe adds "probe": its figures (dtype_probe.ProbeResult.record)."""
        out: dict[str, dict[str, Any]] = {}
        for name, c in self.choices.items():
            out[name] = {"requested": c.requested, "value": c.value, "reason": c.reason}
            if c.probe is not None:
                out[name]["probe"] = c.probe.record()
        return out

    def describe(self) -> str:
        """One line for the start of a run, e.g. "device cpu (auto: no CUDA device), dtype float32 (...)"."""
        names = {"device": "device", "dtype": "dtype", "cache_mode": "KV cache", "deterministic": "deterministic"}
        return ", ".join(f"{names[n]} {c.value} ({'auto: ' if c.requested == AUTO else ''}{c.reason})"
                         for n, c in self.choices.items())


def engine_config(req: EngineRequest, stored: Optional[dict[str, Any]], run_dir: Path,
                  facts: Optional[HostFacts] = None) -> EngineConfig:
    """Resolve --device/--dtype/--cache-mode. `auto` takes the stored run's values when resuming
    (so a run resumes the same on another host), else the host's best choice.
    facts: None reads this host, measuring bf16 against float32 only where an auto dtype on the CPU
    needs it (auto.host_facts(probe=True)); given facts are used as they are."""
    kept = (stored or {}).get("identity", {})
    facts = facts or host_facts(probe=_needs_dtype_probe(req, kept))
    try:
        device = _choose("device", req.device, kept, run_dir, lambda r: choose_device(r, facts))
        dtype = _choose("dtype", req.dtype, kept, run_dir, lambda r: choose_dtype(r, device.value, facts))
        cache = _choose("cache_mode", req.cache_mode, kept, run_dir,
                        lambda r: choose_cache_mode(r, dtype.value, tuple(CACHE_MODES)))
        determ = _deterministic(req.deterministic, dtype.value, device.value, facts, stored, run_dir)
    except SettingError as exc:
        raise BadInput(str(exc)) from None
    window = req.cache_window
    if window is None and stored is not None and CACHE_MODES[cache.value].quantized:
        window = kept.get("cache_window", 0)       # resume as stored (a run from before windows: 0)
    return EngineConfig(device.value, dtype.value, cache.value, req.cache_tokens, req.cache_memory, req.page_size,
                        req.max_batch_size, req.max_chunk_size, window,
                        {"device": device, "dtype": dtype, "cache_mode": cache, "deterministic": determ},
                        req.draft_model, req.ngram_draft, req.num_draft_tokens, determ.value == "on", req.eager)


def _needs_dtype_probe(req: EngineRequest, kept: dict[str, Any]) -> bool:
    """--dtype auto on the CPU that is not a resume's stored dtype."""
    return req.dtype == AUTO and req.device in (AUTO, "cpu") and not isinstance(kept.get("dtype"), str)


def _deterministic(requested: str, dtype: str, device: str, facts: HostFacts, stored: Optional[dict[str, Any]],
                   run_dir: Path) -> Choice:
    """--deterministic resolved; `auto` resumes a stored run as it was made (a run from before the
    setting existed, whose identity lacks it: off)."""
    unavailable = invariant_unavailable_reason(device)
    if requested == AUTO and stored is not None:
        kept = "on" if stored.get("identity", {}).get("deterministic") else "off"
        if kept == "on" and unavailable is not None:
            raise SettingError(f"the run in {run_dir} was made with --deterministic on, which this host cannot "
                               f"resume ({unavailable}); resume it where that works, or start another --output-dir")
        return Choice(AUTO, kept, f"as stored by the run in {run_dir}")
    torch_dtype = getattr(torch, dtype)
    linears = (linear_backend(device, torch_dtype), linear_backend(device, torch_dtype, invariant=True))
    return choose_deterministic(requested, device, dtype, facts, unavailable, linears)


def _choose(name: str, requested: str, kept: dict[str, Any], run_dir: Path,
            choose: Callable[[str], Choice]) -> Choice:
    if requested == AUTO and isinstance(kept.get(name), str):
        try:
            checked = choose(kept[name])                 # still possible on this host?
        except SettingError as exc:
            raise SettingError(f"the run in {run_dir} was made with {name} {kept[name]!r}, which this host "
                               f"cannot resume ({exc}); resume it where that works, or start another "
                               f"--output-dir") from None
        return Choice(AUTO, checked.value, f"as stored by the run in {run_dir}")
    return choose(requested)


def announce(command: str, cfg: EngineConfig) -> None:
    print(f"evalrun {command}: {cfg.describe()}", file=sys.stderr, flush=True)
