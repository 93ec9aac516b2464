"""lm-eval's requests as engine Requests, tokenized as lm-eval 0.4.13's HF backend tokenizes them
(lm_eval/api/model.py TemplateLM.loglikelihood/_encode_pair, lm_eval/models/huggingface.py), and the
engine's answers back as the responses lm-eval's filters and metrics take.

    loglikelihood (context, continuation)   trailing spaces of the context move to the continuation;
        context + continuation is encoded whole and split at the context's own length; an empty
        context is the prefix token (BOS, else EOS). The input is (context + continuation), left-cut
        to max_length + 1 tokens, without its last token: the engine scores the continuation's
        tokens in the prompt's prefill (Request.score_from) and its last one from the sampled
        position's logits. -> (sum of log-probabilities, every token greedy)
    loglikelihood_rolling (text,)   lm-eval's rolling windows of max_length (context_len 1), each one
        such request. -> summed log-probability
    generate_until (context, gen_kwargs)   the context left-cut to max_length - max_gen_toks; stop at
        `until` and the EOS text; text decoded without special tokens, cut at each stop string.

Requests of one document with the same input and scored span are asked once (a multiple-choice
question with single-token choices is one job: lm-eval's `logits_cache`, generalised by the
engine's prefix sharing of the other choices' common context).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from evalrun.engine import SamplerSettings

from .base import Answer, Request, TaskSettingError


@dataclass(frozen=True)
class Encoder:
    """What lm-eval's HF backend knows of the model for building its inputs."""
    tokenizer: Any                  # evalrun.engine.Tokenizer
    max_length: int                 # the model's context (lm-eval's `max_length`)
    prefix_id: int                  # BOS, else EOS: the context of an empty context
    eos_text: str                   # EOS decoded with its special text (an implicit stop string)
    prefix_text: str = ""           # prefix_id decoded: a text starting with it gets no special tokens added
    bos_text: str = ""              # the same rule for a generation's context (HFLM.tok_batch_encode)

    @classmethod
    def for_model(cls, tokenizer: Any, max_length: int) -> "Encoder":
        bos = tokenizer.special_tokens.get("bos_token")
        bos_id = tokenizer.encode_as_transformers(bos, add_special_tokens=False) if bos else []
        prefix = bos_id[0] if len(bos_id) == 1 else tokenizer.eos_token_id
        if prefix is None:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token: lm-eval's log-likelihood requests "
                             "need one to condition an empty context")
        eos = tokenizer.decode([tokenizer.eos_token_id], decode_special_tokens=True) \
            if tokenizer.eos_token_id is not None else None
        return cls(tokenizer, max_length, prefix, eos or "", tokenizer.decode([prefix], decode_special_tokens=True),
                   bos or "")

    def encode(self, text: str, add_special_tokens: Optional[bool] = None) -> list[int]:
        """HFLM.tok_encode: the tokenizer's special tokens are added unless asked otherwise or the text
        already starts with the prefix token's text (a chat template that writes the BOS itself)."""
        if add_special_tokens is None:
            add_special_tokens = not (self.prefix_text and text.startswith(self.prefix_text))
        return self.tokenizer.encode_as_transformers(text, add_special_tokens)

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as TemplateLM.loglikelihood splits them."""
        ctx, (cont,) = self.pairs(context, [continuation])
        return ctx, cont

    def pairs(self, context: str, continuations: list[str]) -> tuple[list[int], list[list[int]]]:
        """pair() of one context with each continuation, the context encoded once."""
        if context == "":
            conts = [self.encode(c, add_special_tokens=False) for c in continuations]
            if len(conts) != 1:
                raise ValueError("an empty context's split depends on its continuation: one at a time")
            cont = conts[0]
            return ([self.prefix_id], [cont]) if cont and cont[0] != self.prefix_id else (cont[:1], [cont[1:]])
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuations = context[:-spaces], [context[-spaces:] + c for c in continuations]
        special = not (self.prefix_text and context.startswith(self.prefix_text))     # encode()'s rule, for all
        ctx, *wholes = self.tokenizer.encode_many_as_transformers([context] + [context + c for c in continuations],
                                                                  special)
        return ctx, [whole[len(ctx):] for whole in wholes]

    def rolling(self, text: str) -> list[tuple[list[int], list[int]]]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        windows = get_rolling_token_windows(token_list=self.encode(text), prefix_token=self.prefix_id,
                                            max_seq_len=self.max_length, context_len=1)
        return [make_disjoint_window(w) for w in windows]


@dataclass(frozen=True)
class Ask:
    """One engine request's part in a response: which request, and which token it predicts last."""
    request: int                    # index into the document's requests
    last: Optional[int] = None      # loglikelihood: the continuation's last token (scored at the sampled row)


def score_request(key: tuple, part: int, ctx: list[int], cont: list[int], max_length: int) -> tuple[Request, int]:
    """The Request of a (context ids, continuation ids) pair and the continuation's last token."""
    if not cont:
        raise ValueError("an empty continuation has no log-likelihood")
    if len(cont) > max_length:
        raise ValueError(f"a continuation of {len(cont)} tokens is longer than the model's context")
    inp = (ctx + cont)[-(max_length + 1):][:-1]
    first = len(inp) - len(cont) + 1                 # the continuation's first token, as a prompt position
    return Request(key, tuple(inp), 1, True, part, score_from=first if first < len(inp) else None), cont[-1]


# generation_kwargs the engine honours (lm-eval's aliases of max_gen_toks included); num_beams only as 1
HONOURED_GEN_KWARGS = ("until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens", "do_sample",
                       "temperature", "top_p", "top_k", "min_p")


def unsupported_gen_kwarg(gen_kwargs: Optional[dict]) -> Optional[str]:
    """The first key of a task's generation_kwargs the engine would not honour, as `key=value` (None: every
    one is honoured): any key outside HONOURED_GEN_KWARGS, num_beams other than 1."""
    for key, value in (gen_kwargs or {}).items():
        if key == "num_beams" and str(value) == "1":
            continue
        if key not in HONOURED_GEN_KWARGS:
            return f"{key}={value!r}"
    return None


def check_gen_kwargs(gen_kwargs: Optional[dict], where: str = "") -> None:
    """TaskSettingError, one line naming the key, for generation_kwargs the engine would not honour."""
    bad = unsupported_gen_kwarg(gen_kwargs)
    if bad is not None:
        raise TaskSettingError(f"{where}generation_kwargs {bad} is not supported (evalrun honours "
                               f"{', '.join(HONOURED_GEN_KWARGS)}, and num_beams=1)")


def generation_request(key: tuple, part: int, enc: Encoder, context: str, gen_kwargs: dict,
                       seed: Optional[int], think: Any = None, max_thinking_tokens: Optional[int] = None) -> Request:
    """`think`: a reasoning model's ThinkEnd (evalrun/tasks/chat.py): the engine checks the stop strings
    only after it, and forces it after `max_thinking_tokens`."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    check_gen_kwargs(gen_kwargs)
    kwargs = normalize_gen_kwargs(dict(gen_kwargs), 256)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=enc.eos_text or None)
    max_gen = int(kwargs.pop("max_gen_toks"))
    if max_gen >= enc.max_length:
        raise ValueError(f"max_gen_toks ({max_gen}) must be less than the model's context ({enc.max_length})")
    ids = enc.encode(context, not (enc.bos_text and context.startswith(enc.bos_text)))
    ids = ids[-(enc.max_length - max_gen):]
    sampler = None
    if kwargs.get("do_sample") and float(kwargs.get("temperature", 0.0)) > 0:
        try:
            sampler = SamplerSettings(temperature=float(kwargs["temperature"]), top_p=float(kwargs.get("top_p", 1.0)),
                                      top_k=int(kwargs.get("top_k", 0) or 0), min_p=float(kwargs.get("min_p", 0.0)))
        except (TypeError, ValueError) as exc:
            raise TaskSettingError(f"generation_kwargs: {exc}") from None
    stops = tuple(enc.tokenizer.eos_token_ids) + tuple(u for u in until if u)
    if think is not None and max_thinking_tokens is not None and max_thinking_tokens >= max_gen:
        raise TaskSettingError(f"--max-thinking-tokens ({max_thinking_tokens}) leaves no room for an answer in the "
                               f"task's max_gen_toks ({max_gen})")
    return Request(key, tuple(ids), max_gen, False, part, stops, sampler, seed if sampler else None,
                   think_end=think.ids if think is not None else (),
                   max_thinking_tokens=max_thinking_tokens if think is not None else None)


def loglikelihood(answer: Answer, last: int) -> tuple[float, bool]:
    """(log p(continuation | context), whether every continuation token was the argmax)."""
    lp = torch.log_softmax(answer.logits[0].float(), dim=-1)
    total = float(lp[last]) + sum(answer.prompt_logprobs or [])
    greedy = int(lp.argmax()) == last and all(answer.prompt_greedy or [])
    return total, bool(greedy)


def cut_at_stops(text: str, gen_kwargs: dict, eos_text: str, think_end: Optional[str] = None) -> str:
    """The generation as lm-eval's HF backend returns it: the thinking (up to the marker's last
    occurrence) removed, then each stop string cuts, in order."""
    from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text
    until = handle_stop_sequences(dict(gen_kwargs).get("until"), eos=eos_text or None)
    return postprocess_generated_text(text, until, think_end)
