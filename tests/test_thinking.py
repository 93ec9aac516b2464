"""Reasoning models in the engine (issue 42): DynamicJob(think_end=..., max_thinking_tokens=...).

Two kinds of model: the tiny random model as it is (for batching, sampling and drafting, checked
against each job run alone), and the same model with a script (`Scripted`): the row that picks the
token after position p puts that token 20 above the row's maximum, so greedy decoding emits a chosen
token sequence (thinking text, the marker, an answer) through the real engine and cache.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import pytest
import torch

from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings, Tokenizer
from evalrun.engine.sampler import draw, make_generator as make_rng
from evalrun.run.runner import answer_of, engine_job
from evalrun.tasks.base import Request
from engine_helpers import make_generator, random_prompts, run_jobs

from spec_helpers import _assert_same, _spec, oracle, tiny, tiny_tok  # noqa: F401  (fixtures)

SAMPLED = SamplerSettings(temperature=0.9, top_p=0.95)


class Scripted:
    """The model, but the logits row at position p makes script[p] the argmax (by 20 logits)."""

    def __init__(self, model: Model, script: dict[int, int]):
        self.model, self.script = model, script

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward(self, batch, cache) -> torch.Tensor:
        logits = self.model.forward(batch, cache)                      # [N, V]
        positions = batch.positions[batch.logits_indices].tolist()
        with torch.inference_mode():
            logits = logits.clone()
            for row, pos in enumerate(positions):
                if pos in self.script:
                    logits[row, self.script[pos]] = logits[row].max() + 20.0
        return logits


def scripted_generator(model: Model, tok: Optional[Tokenizer], prompt: Sequence[int],
                       new_ids: Sequence[int]) -> DynamicGenerator:
    """A generator whose greedy jobs with this prompt's length emit new_ids (then the model's own)."""
    cache = PagedCache(model, max_tokens=1024, page_size=16, mode="fp32")
    cache.fill_unused()
    script = {len(prompt) - 1 + k: t for k, t in enumerate(new_ids)}
    return DynamicGenerator(Scripted(model, script), cache, tok)


def one(gen: DynamicGenerator, job: DynamicJob) -> tuple[dict, list[dict]]:
    """Run one job: (its last result, every result)."""
    gen.enqueue(job)
    results = []
    while gen.num_remaining_jobs():
        results += gen.iterate()
    assert [r["eos"] for r in results] == [False] * (len(results) - 1) + [True]
    return results[-1], results


def new_ids(results: list[dict]) -> list[int]:
    return [t for r in results for t in r["token_ids"]]


@pytest.fixture(scope="module")
def prompt(tiny_tok) -> list[int]:
    return tiny_tok.encode("What is 6 times 7? Think first.")


# --- stops while thinking ---------------------------------------------------------------------
def test_stop_strings_wait_for_the_marker(tiny, tiny_tok, prompt):
    """A stop string inside the thinking does not stop the job; the same one after `</think>` (three
    tokens here) does, held back while streaming; the whole text, thinking included, is returned."""
    tok = tiny_tok
    think = tok.encode("<think>Let me see.\n\nQuestion: what is 6*7? It is 42.")
    marker = tok.encode("</think>")
    answer = tok.encode(" The answer is 42.\n\nQuestion: next one, please")
    stop = "\n\nQuestion:"
    script = think + marker + answer
    assert len(marker) == 3 and stop in tok.decode(think) and stop in tok.decode(answer)

    job = DynamicJob(prompt, 40, stop_conditions=[stop, 2], think_end=marker, identifier=0)
    last, results = one(scripted_generator(tiny, tok, prompt, script), job)
    before_stop = tok.decode(answer).split(stop)[0]
    assert last["eos_reason"] == "stop_string"
    assert last["full_completion"] == tok.decode(think + marker) + before_stop
    assert "".join(r["text"] for r in results) == last["full_completion"]
    assert new_ids(results) == script[: len(new_ids(results))] and len(new_ids(results)) > len(think + marker)
    assert (last["thinking_tokens"], last["thinking_forced"]) == (len(think) + 3, False)
    assert job.state.thinking_tokens == len(think) + 3

    # the reference: without think_end the stop string inside the thinking ends the job
    plain = DynamicJob(prompt, 40, stop_conditions=[stop], identifier=1)
    last, _ = one(scripted_generator(tiny, tok, prompt, script), plain)
    assert last["eos_reason"] == "stop_string" and last["full_completion"] == tok.decode(think).split(stop)[0]
    assert "thinking_tokens" not in last and "thinking_forced" not in last


def test_stop_tokens_end_a_thinking_job_and_unclosed_thinking_runs_to_max_new_tokens(tiny, tiny_tok, prompt):
    tok = tiny_tok
    think = tok.encode("<think>Hmm, hmm.")
    marker = tok.encode("</think>")
    gen = scripted_generator(tiny, tok, prompt, think + [2] + tok.encode(" more thinking"))
    last, results = one(gen, DynamicJob(prompt, 30, stop_conditions=[2, "Hmm"], think_end=marker))
    assert last["eos_reason"] == "stop_token" and new_ids(results) == think + [2]
    assert (last["thinking_tokens"], last["thinking_forced"]) == (len(think) + 1, False)
    assert last["full_completion"] == tok.decode(think)

    gen = scripted_generator(tiny, tok, prompt, think * 4)
    last, results = one(gen, DynamicJob(prompt, 12, stop_conditions=["Hmm"], think_end=marker))
    assert last["eos_reason"] == "max_new_tokens" and new_ids(results) == (think * 4)[:12]
    assert (last["thinking_tokens"], last["thinking_forced"]) == (12, False)


# --- budget forcing ---------------------------------------------------------------------------
FOREVER = 200        # tokens of thinking the scripted model would go on with


def forever(tok: Tokenizer) -> list[int]:
    loop = tok.encode(" wait, let me check again.")
    return (loop * (FOREVER // len(loop) + 1))[:FOREVER]


@pytest.mark.parametrize("budget", [0, 1, 7])
@pytest.mark.parametrize("marker_text", ["</think>", "<|im_end|>"])
def test_the_budget_forces_the_marker_then_the_answer_goes_on(tiny, tiny_tok, prompt, budget, marker_text):
    """A model that would think forever: the marker fills new tokens budget .. budget + L - 1 whatever
    the model says there (budget 0: it comes first), the job goes on after it (here to
    max_new_tokens, the model's own tokens: its script goes on by position), and stop strings count
    from there on."""
    tok = tiny_tok
    marker = tok.encode(marker_text, encode_special_tokens=True)
    assert len(marker) == (3 if marker_text == "</think>" else 1)
    script = forever(tok)
    job = DynamicJob(prompt, 20, think_end=marker, max_thinking_tokens=budget, return_probs=True)
    last, results = one(scripted_generator(tiny, tok, prompt, script), job)
    ids, end = new_ids(results), budget + len(marker)
    assert ids == script[:budget] + marker + script[end:20]
    assert (last["thinking_tokens"], last["thinking_forced"], last["eos_reason"]) == (end, True, "max_new_tokens")
    probs = [p for r in results for p in r["token_probs"]]
    assert all(p < 1e-3 for p in probs[budget:end]) and all(p > 0.99 for p in probs[end:])   # forced, then chosen

    # a stop string after the marker stops the job; in the thinking it did not
    stop = tok.decode(script[end + 2: end + 4])
    assert budget < 7 or stop in tok.decode(script[:budget])          # (the thinking repeats itself)
    job = DynamicJob(prompt, 20, stop_conditions=[stop], think_end=marker, max_thinking_tokens=budget)
    last, results = one(scripted_generator(tiny, tok, prompt, script), job)
    assert last["eos_reason"] == "stop_string" and new_ids(results)[:end] == script[:budget] + marker
    assert last["full_completion"] == tok.decode(script[:budget] + marker) + tok.decode(script[end:]).split(stop)[0]


def test_a_marker_begun_at_the_boundary_is_forced_whole(tiny, tiny_tok, prompt):
    """The model's own marker counts only when it is complete within the budget: one it has begun at
    new token N (here two of its three tokens) is followed by the whole marker from N on."""
    tok = tiny_tok
    marker, think = tok.encode("</think>"), forever(tok)[:10]
    n = 10
    begun = think[: n - 2] + marker[:2] + think
    last, results = one(scripted_generator(tiny, tok, prompt, begun),
                        DynamicJob(prompt, 18, think_end=marker, max_thinking_tokens=n))
    assert new_ids(results)[: n + 3] == think[: n - 2] + marker[:2] + marker
    assert (last["thinking_tokens"], last["thinking_forced"]) == (n + 3, True)

    whole = think[: n - 3] + marker + think          # complete at the last token the budget allows
    last, results = one(scripted_generator(tiny, tok, prompt, whole),
                        DynamicJob(prompt, 18, think_end=marker, max_thinking_tokens=n))
    assert new_ids(results) == whole[:18]
    assert (last["thinking_tokens"], last["thinking_forced"]) == (n, False)


def test_a_marker_longer_than_what_is_left_is_cut_by_max_new_tokens(tiny, tiny_tok, prompt):
    tok = tiny_tok
    marker = tok.encode("</think>")
    last, results = one(scripted_generator(tiny, tok, prompt, forever(tok)),
                        DynamicJob(prompt, 6, think_end=marker, max_thinking_tokens=4))
    assert new_ids(results) == forever(tok)[:4] + marker[:2]
    assert (last["thinking_tokens"], last["thinking_forced"], last["eos_reason"]) == (6, True, "max_new_tokens")


@pytest.mark.parametrize("settings", [None, SAMPLED], ids=["greedy", "sampled"])
def test_a_forced_token_spends_the_draw_of_a_sampled_one(tiny, settings):
    """The rule: a forced position is sampled and its pick replaced, so a job's generator has made one
    draw per generated token (sampling) or none (greedy), forced or not."""
    job = DynamicJob(list(range(5, 17)), 12, gen_settings=settings, seed=11, think_end=[7, 8], max_thinking_tokens=3)
    last, results = one(make_generator(tiny), job)
    assert new_ids(results)[3:5] == [7, 8] and last["thinking_forced"]
    ref = make_rng(11)
    for _ in range(0 if settings is None else 12):
        draw(ref)
    assert torch.equal(job.state.rng.get_state(), ref.get_state())


# --- batching and drafting ------------------------------------------------------------------------
def mixed_jobs(prompts: list[list[int]], natural: list[int]) -> list[DynamicJob]:
    """Thinking and non-thinking jobs, greedy and sampled; natural: a token job 1 emits by itself."""
    kinds = [
        dict(),
        dict(think_end=natural),
        dict(think_end=[7, 8], max_thinking_tokens=3),
        dict(think_end=[9], max_thinking_tokens=5, gen_settings=SAMPLED, seed=1),
        dict(gen_settings=SAMPLED, seed=2),
        dict(think_end=[10, 11, 12], max_thinking_tokens=0, gen_settings=SAMPLED, seed=3),
        dict(think_end=[13], max_thinking_tokens=9, gen_settings=SAMPLED, seed=4),
        dict(think_end=[14, 15], max_thinking_tokens=6),
    ]
    return [DynamicJob(p, 24, identifier=i, **kinds[i % len(kinds)]) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def mix(tiny):
    """(prompts, the token job 1 emits by itself, each job's result run alone)."""
    prompts = random_prompts(8, [5, 19, 33], tiny.config.vocab_size, seed=42)
    free = run_jobs(make_generator(tiny), [DynamicJob(prompts[1], 24, identifier=0)])[0]["all_token_ids"]
    k = next(k for k in range(3, 24) if free[k] not in free[:k])
    natural = [free[k]]
    alone = {}
    for job in mixed_jobs(prompts, natural):
        alone.update(run_jobs(make_generator(tiny), [job]))
    assert alone[1]["thinking_tokens"] == k + 1 and not alone[1]["thinking_forced"]
    return prompts, natural, alone


def _check_thinking(alone: dict, got: dict) -> None:
    _assert_same(alone, got)
    for key, r in alone.items():
        assert (got[key].get("thinking_tokens"), got[key].get("thinking_forced")) == \
               (r.get("thinking_tokens"), r.get("thinking_forced")), key
    for key, think_end, budget in [(2, [7, 8], 3), (3, [9], 5), (5, [10, 11, 12], 0), (7, [14, 15], 6)]:
        assert alone[key]["all_token_ids"][budget: budget + len(think_end)] == think_end
        assert alone[key]["thinking_tokens"] == budget + len(think_end) and alone[key]["thinking_forced"]


def test_batched_jobs_think_as_they_do_alone(tiny, mix):
    prompts, natural, alone = mix
    for kwargs in (dict(), dict(max_batch_size=3, max_chunk_size=37)):
        got = run_jobs(make_generator(tiny, **kwargs), mixed_jobs(prompts, natural))
        _check_thinking(alone, got)


@pytest.mark.parametrize("wrong", [lambda pos: False, lambda pos: pos % 4 == 3], ids=["all-right", "some-wrong"])
def test_drafted_jobs_think_as_they_do_alone(tiny, mix, oracle, wrong):
    """Drafts (an oracle that proposes each job's own continuation, markers included) are cut before
    forced positions, so every forced token is one step's only token, and the tokens are those of
    plain decoding alone, greedy or sampled (the coupled rule)."""
    prompts, natural, alone = mix
    oracle.reference = {tuple(p): alone[i]["all_token_ids"] for i, p in enumerate(prompts)}
    oracle.wrong = staticmethod(wrong)
    gen = _spec(tiny, max_batch_size=5, max_chunk_size=37)
    got = run_jobs(gen, mixed_jobs(prompts, natural))
    _check_thinking(alone, got)
    assert gen.stats()["accepted_draft_tokens"] > 0


def test_a_draft_model_drafts_around_the_forced_marker(tiny, mix):
    """A draft model (the target itself: its drafts are all kept) drafts as far as the budget."""
    prompts, natural, alone = mix
    gen = make_generator(tiny, draft_model=tiny, adaptive_draft=False, max_chunk_size=37)
    _check_thinking(alone, run_jobs(gen, mixed_jobs(prompts, natural)))
    assert gen.stats()["accepted_draft_tokens"] > 0


def test_ngram_drafting_leaves_a_forced_marker_alone(tiny):
    """The n-gram drafter on repetitive text, where it drafts right up to the budget."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() * 6 for n in (2, 3, 5)]
    jobs = lambda: [DynamicJob(p, 30, identifier=i, think_end=[1000 + i], max_thinking_tokens=8 + i,
                               gen_settings=None if i != 1 else SAMPLED, seed=i) for i, p in enumerate(prompts)]
    alone = {}
    for job in jobs():
        alone.update(run_jobs(make_generator(tiny), [job]))
    gen = _spec(tiny)
    got = run_jobs(gen, jobs())
    _assert_same(alone, got)
    assert gen.stats()["drafted_tokens"] > 0
    for i in range(3):
        assert got[i]["all_token_ids"][8 + i] == 1000 + i and got[i]["thinking_tokens"] == 9 + i


# --- the API ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(think_end=[]), "think_end is empty"),
    (dict(think_end="</think>"), "not the text"),
    (dict(think_end=[3, -1]), "think_end must be token ids"),
    (dict(think_end=[3.0]), "think_end must be token ids"),
    (dict(max_thinking_tokens=4), "max_thinking_tokens needs think_end"),
    (dict(think_end=[3], max_thinking_tokens=-1), "max_thinking_tokens must be an integer >= 0"),
    (dict(think_end=[3], max_thinking_tokens=10), r"max_thinking_tokens \(10\) must be below max_new_tokens \(10\)"),
])
def test_bad_thinking_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicJob([1, 2, 3], 10, **kwargs)


def test_a_marker_outside_the_vocabulary_is_refused_at_enqueue(tiny):
    job = DynamicJob([1, 2, 3], 10, think_end=[tiny.config.vocab_size])
    with pytest.raises(ValueError, match="think_end token id .* outside the model's vocabulary"):
        make_generator(tiny).enqueue(job)


def test_the_runner_passes_thinking_through():
    request = Request(("doc",), (1, 2, 3), max_new_tokens=8, think_end=(5, 6), max_thinking_tokens=2)
    job = engine_job(request, identifier=0)
    assert (job.think_end, job.max_thinking_tokens) == ((5, 6), 2)
    assert engine_job(Request(("doc",), (1, 2, 3)), 0).think_end is None
    result = {"job": job, "full_completion": "", "prompt_tokens": 3, "cached_tokens": 0,
              "thinking_tokens": 4, "thinking_forced": True}
    answer = answer_of(request, result)
    assert (answer.thinking_tokens, answer.thinking_forced) == (4, True)
    del result["thinking_tokens"], result["thinking_forced"]
    assert (answer_of(request, result).thinking_tokens, answer_of(request, result).thinking_forced) == (None, False)


def test_generate_takes_the_thinking_arguments(tiny, tiny_tok, prompt):
    """DynamicGenerator.generate(think_end="</think>", max_thinking_tokens=N) is the job's thinking phase."""
    script = forever(tiny_tok)
    gen = scripted_generator(tiny, tiny_tok, prompt, script)
    text = gen.generate(tiny_tok.decode(prompt), 12, stop_conditions=[], think_end="</think>", max_thinking_tokens=4,
                        completion_only=True, encode_special_tokens=True)
    marker = tiny_tok.encode("</think>", encode_special_tokens=True)
    assert text == tiny_tok.decode(script[:4] + marker + script[4 + len(marker):12])
