"""The engine under lm-eval's `--model evalrun` (evalrun/lm_eval_backend.py): the model_args checked
into `BackendSettings`, the engine built as `evalrun <task>` builds it (EngineRequest → engine_config
→ load_model → make_generator: the same defaults for dtype, cache mode, cache size, page size and
--deterministic), and `Engine.answer`, which runs one lm-eval call's Requests.

    Engine.answer(requests, read)
        identical Requests (same input, scored span, budget, stops, sampler, seed) → one job each
        every job enqueued at once (continuous batching; shared contexts computed once)
        a job's last result → Answer → read(i, answer) for each request i it serves, at once
        (a log-likelihood answer's [1, vocab] logits are dropped as soon as they are read)
        → [read(0, ...), read(1, ...), ...] in request order
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
from tqdm import tqdm

from evalrun.engine import DynamicGenerator
from evalrun.errors import BadInput, NonFiniteLogits
from evalrun.run.common import load_model, make_generator, resolve_model_dir
from evalrun.run.engine_config import EngineConfig, EngineRequest, announce, engine_config
from evalrun.run.runner import answer_of, engine_job
from evalrun.tasks.base import Answer, Request
from evalrun.tasks.lm_eval_requests import Encoder

T = TypeVar("T")

# model_args keys → what they set (the error for an unknown key lists them)
MODEL_ARGS = {
    "pretrained": "a Hugging Face model directory or a .gguf file (required)",
    "dtype": "auto (default), float32, bfloat16 or float16",
    "cache_mode": "the KV cache storage: auto (default), fp32, bf16, fp16, q8, q6 or q4",
    "cache_tokens": "the KV cache size in tokens (default: evalrun's, 65536)",
    "max_batch_size": "most jobs running at once (default: as many as the cache holds)",
    "max_length": "the context lm-eval's requests are cut to (default: the model's)",
    "deterministic": "auto (default), on/True or off/False: batch-invariant linears",
    "device": "auto, cpu or cuda[:N] (lm-eval's --device; CUDA where the host has none: auto)",
    "batch_size": "accepted and ignored: the engine batches by itself",
    "chat_template": "under --apply_chat_template, which of the model's named chat templates renders the prompts "
                     "(default: its default one; lm-eval's --apply_chat_template NAME selects one too)",
    "enable_thinking": "true or false, passed to the chat template (Qwen3; default: the template's own default)",
    "think_end_token": "a reasoning model's end-of-thinking marker, a string or a token id: a generation up to its "
                       "last occurrence is removed before the filters (default: none; with enable_thinking=true, "
                       "</think> where the model's template or vocabulary has it)",
    "max_thinking_tokens": "thinking budget: after N generated tokens without the marker, it is forced "
                           "(default: none)",
}


@dataclass(frozen=True)
class BackendSettings:
    pretrained: str
    engine: EngineRequest
    max_length: Optional[int] = None            # None: the model's context (or the cache's, if smaller)
    chat_template: Optional[str] = None         # a named chat template (None: the model's default)
    enable_thinking: Optional[bool] = None      # None: not passed to the template
    think_end_token: Optional[str] = None       # a marker text, or a token id as digits
    max_thinking_tokens: Optional[int] = None

    @classmethod
    def from_model_args(cls, args: dict[str, Any]) -> "BackendSettings":
        """lm-eval's model_args (its parsed `k=v,...` string, plus batch_size/device/max_batch_size
        from its own flags); BadInput in one line for an unknown key or a bad value."""
        unknown = [k for k in args if k not in MODEL_ARGS]
        if unknown:
            raise BadInput(f"--model evalrun: unknown model_args key {unknown[0]!r}; it takes "
                           f"{', '.join(MODEL_ARGS)}")
        if not args.get("pretrained"):
            raise BadInput("--model evalrun needs model_args pretrained=DIR (a model directory or a .gguf file)")
        engine = EngineRequest(device=_device(args.get("device")), dtype=str(args.get("dtype", "auto")),
                               cache_mode=str(args.get("cache_mode", "auto")),
                               cache_tokens=_count(args, "cache_tokens"),
                               deterministic=_on_off(args.get("deterministic", "auto")),
                               max_batch_size=_count(args, "max_batch_size"))
        template = args.get("chat_template")
        think_end = args.get("think_end_token")
        if think_end is not None and str(think_end) == "":
            raise BadInput("--model evalrun: model_args think_end_token is empty")
        return cls(str(args["pretrained"]), engine, _count(args, "max_length"),
                   None if template in (None, "", "default") else str(template),
                   _bool_or_none(args, "enable_thinking"), None if think_end is None else str(think_end),
                   _count(args, "max_thinking_tokens", zero=True))


def _count(args: dict[str, Any], key: str, zero: bool = False) -> Optional[int]:
    value = args.get(key)
    if value is None or value == "auto":
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number < (0 if zero else 1) or str(number) != str(value).strip():
        kind = "a non-negative" if zero else "a positive"
        raise BadInput(f"--model evalrun: model_args {key} must be {kind} integer, got {value!r}")
    return number


def _bool_or_none(args: dict[str, Any], key: str) -> Optional[bool]:
    value = args.get(key)
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise BadInput(f"--model evalrun: model_args {key} must be true or false, got {value!r}")
    return text == "true"


def _device(value: Any) -> str:
    """lm-eval's device (its CLI passes cuda:0 unless told otherwise): a CUDA device where this host
    has one, else, as lm-eval's HF backend does, evalrun's choice (auto: the CPU)."""
    device = str(value or "auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"evalrun lm-eval backend: lm-eval asks for device {device}, which this host lacks: device auto",
              file=sys.stderr)
        return "auto"
    return device


def _on_off(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    return {"true": "on", "false": "off"}.get(text, text)      # engine_config refuses anything else


@dataclass
class Engine:
    generator: DynamicGenerator
    encoder: Encoder                # lm-eval's HF tokenization, cut to encoder.max_length
    config: EngineConfig
    model_dir: Path

    @classmethod
    def open(cls, settings: BackendSettings) -> "Engine":
        model_dir = resolve_model_dir(settings.pretrained)
        cfg = engine_config(settings.engine, None, Path(model_dir))
        announce("lm-eval backend", cfg)
        model, tokenizer = load_model(cfg, model_dir)
        generator = make_generator(cfg, model, tokenizer)
        fits = min(model.max_seq_len, generator.cache.max_tokens)
        if settings.max_length is not None and settings.max_length > fits:
            raise BadInput(f"--model evalrun: max_length {settings.max_length} is longer than the model's context "
                           f"or the KV cache ({fits} tokens)")
        return cls(generator, Encoder.for_model(tokenizer, settings.max_length or fits), cfg, Path(model_dir))

    def answer(self, requests: Sequence[Request], read: Callable[[int, Answer], T], progress: bool = False) -> list[T]:
        """[read(i, answer of requests[i]) for each i], every request queued at once, identical
        ones asked once. NonFiniteLogits where a scored position's logits held NaN or Inf."""
        owners: dict[Request, list[int]] = {}
        for i, r in enumerate(requests):
            owners.setdefault(replace(r, doc_key=(), part=0), []).append(i)
        if not owners:
            return []
        out: list[Any] = [None] * len(requests)
        self.generator.enqueue([engine_job(r, (r, served)) for r, served in owners.items()])
        with tqdm(total=len(owners), disable=not progress, unit="job", dynamic_ncols=True) as bar:
            while self.generator.num_remaining_jobs():
                for result in self.generator.iterate():
                    if result["eos"]:
                        request, served = result["identifier"]
                        answer = _answer(request, result)
                        for i in served:
                            out[i] = read(i, answer)
                        bar.update(1)
        return out


def _answer(request: Request, result: dict) -> Answer:
    """A job's last result as an Answer; a broken model's NaN/Inf logits raise."""
    if result.get("nonfinite_logits", 0):
        raise NonFiniteLogits(f"the model's logits hold NaN or Inf at a scored position of a {len(request.input_ids)}"
                              "-token request: the model or its dtype is broken")
    return answer_of(request, result)
