"""lm-evaluation-harness's model backend `evalrun`: lm-eval's evaluator (its tasks, filters, metrics,
groups, output files) with evalrun's engine answering the requests.

    python -m evalrun.lm_eval_backend --model evalrun --model_args pretrained=DIR[,dtype=float32,...] \\
        --tasks arc_easy --num_fewshot 5 --output_path out/          # lm-eval's own CLI, any of its flags

    import evalrun.lm_eval_backend                                    # registers "evalrun"
    lm_eval.simple_evaluate(model="evalrun", model_args="pretrained=DIR", tasks=[...])

With lm-eval's --apply_chat_template (and --fewshot_as_multiturn, --system_instruction) the prompts are
rendered by the model's chat template as lm-eval's HF backend renders them (model_args chat_template,
enable_thinking, think_end_token and max_thinking_tokens as `evalrun task`'s chat flags).

Requests are built exactly as `evalrun task` builds them (evalrun/tasks/lm_eval_requests.py: lm-eval's
HF tokenization, scoring in the prefill), so the numbers are those of `evalrun task` and, in float32,
those of lm-eval's HF backend. Each call's requests are queued at once (evalrun/lm_eval_backend_engine.py).
model_args: lm_eval_backend_engine.MODEL_ARGS.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any, Optional, Union

import lm_eval.models  # noqa: F401 - lm-eval's own backends: get_model fills its registry only while it is empty
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from evalrun.errors import BadInput, RunFailed, as_bad_input
from evalrun.lm_eval_backend_engine import BackendSettings, Engine
from evalrun.tasks.chat import DEFAULT_TEMPLATE, ChatOptions, ChatRenderer, ThinkEnd, resolve_think_end
from evalrun.results.text import terminal_safe
from evalrun.tasks.base import Answer
from evalrun.tasks.lm_eval_code import code_eval_in_sandbox
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
        # lm-eval bootstraps some stderrs in a multiprocessing pool forked from this process, whose workers
        # can hang once the engine's threads exist; its in-process path gives the same numbers
        os.environ.setdefault("DISABLE_MULTIPROC", "1")
        settings = BackendSettings.from_model_args(model_args)
        self.engine = Engine.open(settings)
        self._device = self.engine.config.device
        self.chat = ChatOptions(settings.chat_template or DEFAULT_TEMPLATE, enable_thinking=settings.enable_thinking,
                                think_end=settings.think_end_token, max_thinking_tokens=settings.max_thinking_tokens)
        self.think = think_end_of(self.engine.encoder.tokenizer, self.chat, settings)
        self._render: Optional[ChatRenderer] = None

    @property
    def max_length(self) -> int:
        return self.engine.encoder.max_length

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval's results record under `config` (HF's backend records model_dtype too)."""
        cfg = self.engine.config
        return {"model_dtype": cfg.dtype, "evalrun": {
            "device": cfg.device, "cache_mode": cfg.cache_mode, "deterministic": cfg.deterministic,
            "page_size": cfg.page_size, "max_length": self.max_length, "engine_choices": cfg.choices_record()}}

    # -- chat templates (lm-eval's --apply_chat_template: it renders each prompt through these) -------------

    def chat_template(self, chat_template: Union[bool, str, None] = False) -> Optional[str]:
        """The source of the template that renders the prompts (None: no template). lm-eval's
        `--apply_chat_template NAME` passes the name here before any prompt is built: it selects the model's
        template of that name (ChatTemplateError in one line where the model has none such)."""
        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str) and chat_template not in ("", DEFAULT_TEMPLATE, self.chat.template):
            self.engine.encoder.tokenizer.chat_template_source(chat_template)       # the model has it
            self.chat, self._render = replace(self.chat, template=chat_template), None
        return self.engine.encoder.tokenizer.chat_template_source(self.chat.template_name)

    @property
    def tokenizer_name(self) -> str:
        """lm-eval's request-cache fingerprint under a template: the model's path ("/" as "__", as HF's
        backend writes it) and the selected template's hash, so a cache of prompts rendered by another
        template is not read back."""
        template = self.engine.encoder.tokenizer.chat_template_hash(self.chat.template_name)[:16]
        return f"{str(self.engine.model_dir).replace('/', '__')}__{template}"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The messages rendered as lm-eval's HF backend renders them (continue_final_message when no
        generation prompt is added; a template that refuses the system turn is rendered without it),
        with enable_thinking passed where model_args set it."""
        if self._render is None:
            self._render = ChatRenderer(self.engine.encoder.tokenizer, self.chat, keep_sources=False)
        return self._render(chat_history, add_generation_prompt)

    # -- requests ------------------------------------------------------------------------------------------------

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
        asked = [generation_request(NO_KEY, 0, enc, r.args[0], r.args[1], request_seed(base, i), self.think,
                                    self.chat.max_thinking_tokens)
                 for i, r in enumerate(requests)]
        think = self.think.text if self.think is not None else None

        def read(i: int, answer: Answer) -> str:
            return cut_at_stops(answer.text, requests[i].args[1], enc.eos_text, think)
        out = self.engine.answer(asked, read, progress=not disable_tqdm)
        return self._cached("generate_until", requests, out)

    def _cached(self, kind: str, requests: list[Instance], out: list) -> list:
        """lm-eval's --use_cache: each answer handed to its response cache (a no-op without one)."""
        for r, value in zip(requests, out):
            self.cache_hook.add_partial(kind, r.args, value)
        return out


def think_end_of(tokenizer: Any, chat: ChatOptions, settings: BackendSettings) -> Optional[ThinkEnd]:
    """The end-of-thinking marker a generation is cut at: model_args think_end_token; with
    enable_thinking=true and none given, `</think>` where the model's template or vocabulary has it
    (lm-eval's HF backend requires think_end_token there); else none. BadInput where a thinking budget
    or enable_thinking=true has no marker."""
    if settings.think_end_token is None and not settings.enable_thinking:
        if settings.max_thinking_tokens is not None:
            raise BadInput("--model evalrun: model_args max_thinking_tokens needs a marker to force: give "
                           "think_end_token")
        return None
    try:
        think = resolve_think_end(tokenizer, replace(chat, max_thinking_tokens=None))
    except ValueError as exc:                   # a token id outside the vocabulary
        raise BadInput(f"--model evalrun: model_args think_end_token: {exc}") from None
    if think is None and settings.think_end_token is not None:
        raise BadInput(f"--model evalrun: model_args think_end_token {settings.think_end_token!r} is no text or "
                       "no token of this model")
    if think is None:
        raise BadInput("--model evalrun: model_args enable_thinking=true needs think_end_token: the model's chat "
                       "template and vocabulary declare no </think>")
    return think


def main() -> int:
    """lm-eval's own CLI (lm_eval.__main__.cli_evaluate, argv as lm-eval reads it) with "evalrun"
    registered, its packaged tasks' index read from evalrun's cache (evalrun/tasks/lm_eval_index.py);
    an input error is one line and exit code 2. HF evaluate's code_eval (lm-eval's code tasks, run with
    its --confirm_run_unsafe_code) runs in evalrun's sandbox (evalrun/tasks/lm_eval_code.py)."""
    from lm_eval.__main__ import cli_evaluate
    try:
        with lm_eval_uses_the_cache(), code_eval_in_sandbox():
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
