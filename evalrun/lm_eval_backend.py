"""lm-evaluation-harness's model backend `evalrun`: lm-eval's evaluator (its tasks, filters, metrics,
groups, output files) with evalrun's engine answering the requests.

    python -m evalrun.lm_eval_backend --model evalrun --model_args pretrained=DIR[,dtype=float32,...] \\
        --tasks arc_easy --num_fewshot 5 --output_path out/          # lm-eval's own CLI, any of its flags

    import evalrun.lm_eval_backend                                    # registers "evalrun"
    lm_eval.simple_evaluate(model="evalrun", model_args="pretrained=DIR", tasks=[...])

Requests are built exactly as `evalrun task` builds them (evalrun/tasks/lm_eval_requests.py: lm-eval's
HF tokenization, scoring in the prefill), so the numbers are those of `evalrun task` and, in float32,
those of lm-eval's HF backend. Each call's requests are queued at once (evalrun/lm_eval_backend_engine.py).
model_args: lm_eval_backend_engine.MODEL_ARGS.
"""
from __future__ import annotations

import sys
from typing import Any

import lm_eval.models  # noqa: F401 - lm-eval's own backends: get_model fills its registry only while it is empty
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from evalrun.errors import BadInput, RunFailed, as_bad_input
from evalrun.lm_eval_backend_engine import BackendSettings, Engine
from evalrun.results.text import terminal_safe
from evalrun.tasks.base import Answer
from evalrun.tasks.lm_eval_index import lm_eval_uses_the_cache
from evalrun.tasks.lm_eval_requests import cut_at_stops, generation_request, loglikelihood, score_request

NO_KEY = ()                          # Requests of a call carry no document key: the call keeps their order


def request_seed(base: int, index: int) -> int:
    """The seed of the index-th sampled request of a call: lm-eval's torch seed (`base`) and the
    request's place, so the repeats of one request (consecutive places) sample differently."""
    return (base * 1_000_003 + index) % 2**31


@register_model("evalrun")
class EvalrunLM(LM):
    """lm-eval's LM over evalrun's engine; model_args as MODEL_ARGS lists them."""

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        self.engine = Engine.open(BackendSettings.from_model_args(model_args))
        self._device = self.engine.config.device

    @property
    def max_length(self) -> int:
        return self.engine.encoder.max_length

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval's results record under `config` (HF's backend records model_dtype too)."""
        cfg = self.engine.config
        return {"model_dtype": cfg.dtype, "evalrun": {
            "device": cfg.device, "cache_mode": cfg.cache_mode, "deterministic": cfg.deterministic,
            "page_size": cfg.page_size, "max_length": self.max_length, "engine_choices": cfg.choices_record()}}

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        enc = self.engine.encoder
        asked = [score_request(NO_KEY, 0, *enc.pair(*r.args[:2]), enc.max_length) for r in requests]

        def read(i: int, answer: Answer) -> tuple[float, bool]:
            return loglikelihood(answer, asked[i][1])
        out = self.engine.answer([req for req, _ in asked], read, progress=not disable_tqdm)
        return self._cached("loglikelihood", requests, out)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = True) -> list[float]:
        """Each text's log-likelihood: the sum over lm-eval's rolling windows, each window one job."""
        enc = self.engine.encoder
        windows = [(i, *score_request(NO_KEY, 0, ctx, cont, enc.max_length))
                   for i, r in enumerate(requests) for ctx, cont in enc.rolling(r.args[0])]

        def read(j: int, answer: Answer) -> float:
            return loglikelihood(answer, windows[j][2])[0]
        scores = self.engine.answer([req for _, req, _ in windows], read, progress=not disable_tqdm)
        totals = [0.0] * len(requests)
        for (i, _, _), score in zip(windows, scores):       # in window order, as `evalrun task` sums them
            totals[i] += score
        return self._cached("loglikelihood_rolling", requests, totals)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = True) -> list[str]:
        """Greedy, or sampled where gen_kwargs ask (do_sample, temperature > 0), seeded per request."""
        enc, base = self.engine.encoder, torch.initial_seed()
        asked = [generation_request(NO_KEY, 0, enc, r.args[0], r.args[1], request_seed(base, i))
                 for i, r in enumerate(requests)]

        def read(i: int, answer: Answer) -> str:
            return cut_at_stops(answer.text, requests[i].args[1], enc.eos_text)
        out = self.engine.answer(asked, read, progress=not disable_tqdm)
        return self._cached("generate_until", requests, out)

    def _cached(self, kind: str, requests: list[Instance], out: list) -> list:
        """lm-eval's --use_cache: each answer handed to its response cache (a no-op without one)."""
        for r, value in zip(requests, out):
            self.cache_hook.add_partial(kind, r.args, value)
        return out


def main() -> int:
    """lm-eval's own CLI (lm_eval.__main__.cli_evaluate, argv as lm-eval reads it) with "evalrun"
    registered, its packaged tasks' index read from evalrun's cache (evalrun/tasks/lm_eval_index.py);
    an input error is one line and exit code 2."""
    from lm_eval.__main__ import cli_evaluate
    try:
        with lm_eval_uses_the_cache():
            cli_evaluate()
    except (BadInput, RunFailed) as exc:
        print(f"error: {terminal_safe(str(exc), True)}", file=sys.stderr)
        return 2 if isinstance(exc, BadInput) else 1
    except Exception as exc:  # noqa: BLE001 - only the user's input errors become one line; the rest re-raise
        bad = as_bad_input(exc)
        if bad is None:
            raise
        print(f"error: {terminal_safe(str(bad), True)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # NOTE: run as `python -m`, this file's own class is the one registered; importing
    # evalrun.lm_eval_backend here would register a second class under "evalrun", which lm-eval refuses.
    sys.exit(main())
