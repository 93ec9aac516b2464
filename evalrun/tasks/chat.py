"""Chat templates on every task: the options, lm-eval's prompt as messages, the rendering.

An instruct model is asked through its chat template the way lm-evaluation-harness 0.4.13 asks it
(`--apply_chat_template --fewshot_as_multiturn`, HF backend; lm_eval/api/task.py fewshot_context):

    [system]     system instruction + description      (maybe_delimit: "\\n\\n" between them)
    [user]       few-shot question   [assistant] its answer     x num_fewshot   (--fewshot-as-multiturn)
    [user]       the question
    -> rendered with add_generation_prompt (a task with a gen_prefix: the prefix is a last assistant
       message the model continues, continue_final_message)

Without --fewshot-as-multiturn the turns after the system one are joined as plain text into one
user message (lm-eval's multiturn_to_singleturn). A template that refuses a system turn
(raise_exception) is rendered again without it, as lm-eval does. Log-likelihood continuations lose
their separator space under a template (the task's own code applies lm-eval's rule).

Reasoning models: the end-of-thinking marker (--think-end, else `</think>` where the model's
template or vocabulary has it) splits a generation: the text up to and including its last
occurrence is the thinking, removed before filters and extraction (lm-eval's
postprocess_generated_text rule); the raw text stays in the row.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

import jinja2

from .base import TaskSettingError
from .spec import CliArg

AUTO_THINK_END = "</think>"
DEFAULT_TEMPLATE = "default"


CHAT_CLI_ARGS = (
    CliArg(("--apply-chat-template",), "ask through the model's chat template: its default one, or the named one "
           "(default: off; plain prompts)", nargs="?", const=DEFAULT_TEMPLATE, metavar="NAME"),
    CliArg(("--fewshot-as-multiturn",), "few-shot examples as user/assistant turns (default: on with "
           "--apply-chat-template)", switch=True),
    CliArg(("--no-fewshot-as-multiturn",), "few-shot examples and the question as one user message, as lm-eval "
           "without --fewshot_as_multiturn (default: off)", dest="no_fewshot_as_multiturn", switch=True),
    CliArg(("--system-instruction",), "a system instruction before the task's description (default: none)",
           metavar="TEXT"),
    CliArg(("--think-end",), "end-of-thinking marker of a reasoning model, a token or a string or a token id; the "
           "generated text up to it is removed before scoring (default: </think> where the model's template or "
           "vocabulary has it, with --apply-chat-template)", metavar="TOKEN_OR_STRING"),
    CliArg(("--max-thinking-tokens",), "thinking budget: after N generated tokens without the end marker, the "
           "marker is forced (default: none)", type=int, metavar="N"),
    CliArg(("--enable-thinking",), "pass enable_thinking=true to the chat template (Qwen3; default: the "
           "template's own default)", switch=True),
    CliArg(("--disable-thinking",), "pass enable_thinking=false to the chat template (default: off)", switch=True),
)
CHAT_ARG_NAMES = tuple(a.name for a in CHAT_CLI_ARGS)


@dataclass(frozen=True)
class ChatOptions:
    """How a task's prompts meet the model's chat template (the defaults: plain prompts)."""
    template: Optional[str] = None              # None: no chat template; "default" or a template's name
    fewshot_as_multiturn: bool = True           # with a template: few-shot examples as turns
    system_instruction: Optional[str] = None
    enable_thinking: Optional[bool] = None      # None: not passed to the template
    think_end: Optional[str] = None             # None: auto-detected (with a template)
    max_thinking_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < 0:
            raise TaskSettingError(f"--max-thinking-tokens must be >= 0, got {self.max_thinking_tokens}")
        if self.think_end is not None and not self.think_end:
            raise TaskSettingError("--think-end is empty")

    @classmethod
    def from_cli(cls, values: Mapping[str, Any]) -> "ChatOptions":
        template = values.get("apply_chat_template")
        multi, single = values.get("fewshot_as_multiturn"), values.get("no_fewshot_as_multiturn")
        if multi and single:
            raise TaskSettingError("give --fewshot-as-multiturn or --no-fewshot-as-multiturn, not both")
        if (multi or single) and template is None:
            flag = "--fewshot-as-multiturn" if multi else "--no-fewshot-as-multiturn"
            raise TaskSettingError(f"{flag} takes effect only with --apply-chat-template")
        enable, disable = values.get("enable_thinking"), values.get("disable_thinking")
        if enable and disable:
            raise TaskSettingError("give --enable-thinking or --disable-thinking, not both")
        if (enable or disable) and template is None:
            raise TaskSettingError(f"--{'enable' if enable else 'disable'}-thinking is passed to the chat template: "
                                   "it needs --apply-chat-template")
        return cls(template, not single, values.get("system_instruction"),
                   True if enable else False if disable else None, values.get("think_end"),
                   values.get("max_thinking_tokens"))

    @property
    def on(self) -> bool:
        return self.template is not None

    @property
    def template_name(self) -> Optional[str]:
        """The name to ask the tokenizer for (None: the model's default template)."""
        return None if self.template in (None, DEFAULT_TEMPLATE) else self.template

    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}

    def identity(self) -> dict[str, Any]:
        """What changes the prompts or the answers (the template's hash is added where the model is known)."""
        out: dict[str, Any] = {}
        if self.on:
            out.update(template=self.template, fewshot_as_multiturn=self.fewshot_as_multiturn)
            if self.enable_thinking is not None:
                out["enable_thinking"] = self.enable_thinking
        if self.system_instruction is not None:
            out["system_instruction_sha256"] = hashlib.sha256(self.system_instruction.encode()).hexdigest()[:16]
        if self.think_end is not None:
            out["think_end"] = self.think_end
        if self.max_thinking_tokens is not None:
            out["max_thinking_tokens"] = self.max_thinking_tokens
        return out


def with_chat_options(make: Any) -> Any:
    """A TaskSpec.options callable: the task's own options record with `chat=ChatOptions(...)`."""
    def options(**values: Any) -> Any:
        chat = ChatOptions.from_cli({k: values.pop(k) for k in CHAT_ARG_NAMES if k in values})
        return make(**values, chat=chat)
    return options


# -- lm-eval's prompt as messages (lm_eval/api/utils.py Message, maybe_delimit, multiturn_to_singleturn) ---------

@dataclass(frozen=True)
class Turn:
    role: str                       # "system" | "user" | "assistant"
    content: str
    delimiter: str = ""             # what follows the content in the plain-text prompt

    def text(self) -> str:
        return self.content + self.delimiter


def maybe_delimit(prefix: Optional[str], suffix: Optional[str], delimiter: str = " ") -> str:
    """prefix + delimiter + suffix, without the delimiter where either side has whitespace at the join."""
    if not prefix:
        return suffix or ""
    if not suffix:
        return prefix
    return prefix + suffix if prefix[-1].isspace() or suffix[0].isspace() else prefix + delimiter + suffix


def qa_turns(description: str, shots: Sequence[tuple[str, str]], question: str,
             system_instruction: Optional[str] = None, target_delimiter: str = " ",
             fewshot_delimiter: str = "\n\n") -> list[Turn]:
    """lm-eval's fewshot_context messages of a task without a gen_prefix: the system turn, each shot
    as (question, answer) turns, the question."""
    turns = []
    system = maybe_delimit(system_instruction, description, fewshot_delimiter)
    if system:
        turns.append(Turn("system", system))
    for q, a in shots:
        turns += [Turn("user", q, target_delimiter), Turn("assistant", a, fewshot_delimiter)]
    turns.append(Turn("user", question))
    return turns


def plain_prompt(turns: Sequence[Turn]) -> str:
    return "".join(t.text() for t in turns)


def chat_messages(turns: Sequence[Turn], multiturn: bool) -> list[dict[str, str]]:
    """The messages a template renders: every turn, or (single turn) the system turn and the rest as
    one user message (a last assistant turn, a gen_prefix, stays its own message)."""
    if multiturn:
        return [{"role": t.role, "content": t.content} for t in turns]
    system, rest = (turns[0], list(turns[1:])) if turns and turns[0].role == "system" else (None, list(turns))
    tail = [rest.pop()] if rest and rest[-1].role == "assistant" else []
    if rest:
        rest[-1] = replace(rest[-1], delimiter="")
    out = [{"role": "user", "content": plain_prompt(rest)}] + [{"role": t.role, "content": t.content} for t in tail]
    return ([{"role": "system", "content": system.content}] if system else []) + out


# -- rendering -----------------------------------------------------------------------------------------------------

class ChatRenderer:
    """Renders messages with a model's chat template as lm-eval's HF backend does
    (HFLM.apply_chat_template): continue_final_message when no generation prompt is added; a
    template that raises on the system turn is rendered again without it."""

    def __init__(self, tokenizer: Any, options: ChatOptions, keep_sources: bool = True):
        self.tokenizer, self.options, self.keep_sources = tokenizer, options, keep_sources
        self.sources: dict[str, dict[str, Any]] = {}     # rendered text -> what it was rendered from

    def __call__(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        try:
            return self._render(messages, add_generation_prompt)
        except jinja2.exceptions.TemplateError:
            if not any(m["role"] == "system" for m in messages):
                raise
            return self._render([m for m in messages if m["role"] != "system"], add_generation_prompt)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=not add_generation_prompt,
            template=self.options.template_name, **self.options.template_kwargs())
        if self.keep_sources:
            self.sources[text] = {"messages": messages, "generation_prompt": add_generation_prompt}
        return text


@dataclass(frozen=True)
class ThinkEnd:
    """A reasoning model's end-of-thinking marker: its text (what splits a generation) and its ids
    (what the engine forces when the thinking budget runs out)."""
    text: str
    ids: tuple[int, ...]

    def answer(self, text: str) -> str:
        """The answer part of a generation: after the marker's last occurrence, left-stripped (the
        whole text when the marker never came; lm-eval's rule)."""
        return text.split(self.text)[-1].lstrip() if self.text in text else text


def resolve_think_end(tokenizer: Any, options: ChatOptions) -> Optional[ThinkEnd]:
    """The marker --think-end names (a token id, a special token, or a string), else `</think>` where
    the model's chat template mentions it or its vocabulary has it as one token (with a template);
    None when there is none. TaskSettingError where --max-thinking-tokens has no marker to force."""
    spec = options.think_end
    if spec is not None and spec.isdigit():
        ids: tuple[int, ...] = (int(spec),)
        text = tokenizer.decode(list(ids), decode_special_tokens=True)
    elif spec is not None:
        text, ids = spec, tuple(tokenizer.encode_as_transformers(spec, add_special_tokens=False))
    elif options.on and _declares_think_end(tokenizer):
        text, ids = AUTO_THINK_END, tuple(tokenizer.encode_as_transformers(AUTO_THINK_END, add_special_tokens=False))
    else:
        text, ids = "", ()
    if not text or not ids:
        if options.max_thinking_tokens is not None:
            raise TaskSettingError("--max-thinking-tokens needs an end-of-thinking marker: the model declares none; "
                                   "name it with --think-end")
        return None
    return ThinkEnd(text, ids)


def chat_identity(options: ChatOptions, tokenizer: Any) -> dict[str, Any]:
    """The run identity's `chat` part: the options that change prompts or answers and the selected
    template's hash (checked before any weight loads: TaskSettingError in one line when the model has
    no chat template or not the named one)."""
    out = options.identity()
    if options.on:
        try:
            out["template_sha256"] = tokenizer.chat_template_hash(options.template_name)
        except ValueError as exc:
            raise TaskSettingError(f"--apply-chat-template: {exc}") from None
    return out


def _declares_think_end(tokenizer: Any) -> bool:
    source = getattr(tokenizer, "chat_template", None) or ""
    return AUTO_THINK_END in source or len(tokenizer.encode_as_transformers(AUTO_THINK_END,
                                                                             add_special_tokens=False)) == 1
