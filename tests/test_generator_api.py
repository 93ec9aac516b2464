"""Public generator API on real runs: stops, min_new_tokens, streaming text, seeds, result dicts.

References are independent of the code under test: an unconstrained greedy run (for stop
strings), a transformers greedy loop (for stop tokens and min_new_tokens), the tokenizer's
one-shot decode (for streaming), and runs of the same job in other batch mixes (for seeds).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import pytest
import torch
from tiny_models import rig_eos_trigger, save_tiny_model

from evalrun.engine import (DynamicGenerator, DynamicJob, GeneratorResult, GeneratorStats, Model, PagedCache,
                    SamplerSettings, Tokenizer)

transformers = pytest.importorskip("transformers")

REPLACEMENT_CHAR = "\ufffd"


class Engine:
    """A loaded model + tokenizer; `generator()` gives a fresh generator over a NaN-poisoned cache."""

    def __init__(self, model_dir: Path, mode: str = "fp32"):
        self.dir = model_dir
        self.model = Model.load(model_dir, dtype="float32")
        self.tokenizer = Tokenizer.load(model_dir)
        self.mode = mode

    def generator(self, page_size: int = 16, max_tokens: int = 4096, **kwargs: Any) -> DynamicGenerator:
        cache = PagedCache(self.model, max_tokens=max_tokens, page_size=page_size, mode=self.mode)
        cache.fill_unused()
        return DynamicGenerator(self.model, cache, self.tokenizer, **kwargs)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Engine:
    return Engine(tiny_model_dir)


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> Engine:
    return Engine(smollm2_dir)


def run(generator: DynamicGenerator, jobs: Sequence[DynamicJob]) -> dict[Any, list[GeneratorResult]]:
    """Enqueue jobs, iterate to the end; every result of each job, by identifier, in order."""
    generator.enqueue(list(jobs))
    out: dict[Any, list[GeneratorResult]] = {job.identifier: [] for job in jobs}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            out[result["identifier"]].append(result)
    for results in out.values():
        assert [r["eos"] for r in results] == [False] * (len(results) - 1) + [True]
    return out


def token_ids(results: list[GeneratorResult]) -> list[int]:
    return [t for r in results for t in r["token_ids"]]


def streamed(results: list[GeneratorResult]) -> str:
    return "".join(r["text"] for r in results)


def greedy(engine: Engine, prompt: str, max_new_tokens: int) -> tuple[list[int], str]:
    """Unconstrained greedy reference run: (token ids, full completion)."""
    job = DynamicJob(engine.tokenizer.encode(prompt), max_new_tokens, identifier=0)
    (results,) = run(engine.generator(), [job]).values()
    assert results[-1]["eos_reason"] == "max_new_tokens"
    return token_ids(results), results[-1]["full_completion"]


# --- stop strings -------------------------------------------------------------------------


def pick_spanning_stop(tokenizer: Tokenizer, ids: list[int], first: int = 2) -> str:
    """A stop string spanning three tokens' text: the last char of token k, all of token
    k+1 and the first char of token k+2, for the first k >= `first` where that is clean."""
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    pieces = [texts[i + 1][len(texts[i]):] for i in range(len(ids))]
    for k in range(first, len(ids) - 2):
        window = texts[k + 3]
        if REPLACEMENT_CHAR in window or not all(texts[i + 1].startswith(texts[i]) for i in range(k + 3)):
            continue
        a, b, c = pieces[k: k + 3]
        if a and b and c:
            return a[-1] + b + c[0]
    raise AssertionError(f"no clean three-token window in {pieces}")


def check_stop_string(engine: Engine, prompt: str, max_new_tokens: int) -> None:
    ids, text = greedy(engine, prompt, max_new_tokens)
    stop = pick_spanning_stop(engine.tokenizer, ids)
    want_text = text[: text.index(stop)]
    want_tokens = next(i for i in range(1, len(ids) + 1) if stop in engine.tokenizer.decode(ids[:i]))
    job = DynamicJob(engine.tokenizer.encode(prompt), max_new_tokens, stop_conditions=[stop], identifier=0)
    (results,) = run(engine.generator(), [job]).values()
    last = results[-1]
    assert last["eos_reason"] == "stop_string"
    assert last["full_completion"] == want_text
    assert last["new_tokens"] == want_tokens and token_ids(results) == ids[:want_tokens]
    assert streamed(results) == want_text             # no part of the stop string ever streamed
    so_far = ""
    for r in results:
        so_far += r["text"]
        assert want_text.startswith(so_far)


def test_stop_string_across_token_boundaries_tiny(tiny: Engine) -> None:
    check_stop_string(tiny, "The capital of France is", 16)


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
def test_stop_conditions_per_quantized_cache_mode(tiny_kv32_dir: Path, mode: str) -> None:
    """Stop strings across token boundaries and stop tokens with min_new_tokens, in a quantized
    cache: the reference is the same mode's own greedy run without stops."""
    engine = Engine(tiny_kv32_dir, mode)
    check_stop_string(engine, "The capital of France is", 16)
    prompt = engine.tokenizer.encode("The capital of France is")
    ids, _ = greedy(engine, "The capital of France is", 8)
    jobs = [DynamicJob(prompt, 8, 0, stop_conditions=[ids[3]], identifier="fourth"),
            DynamicJob(prompt, 8, 2, stop_conditions=[ids[0]], identifier="banned")]
    got = run(engine.generator(), jobs)
    cut = ids.index(ids[3]) + 1
    assert token_ids(got["fourth"]) == ids[:cut] and got["fourth"][-1]["eos_reason"] == "stop_token"
    assert ids[0] not in token_ids(got["banned"])[:2]


@pytest.mark.slow
def test_stop_string_across_token_boundaries_smollm2(smol: Engine) -> None:
    check_stop_string(smol, "Here is a short story about a dog named Max.\n\n", 16)


def test_stop_string_in_min_new_tokens_window_is_ignored(tiny: Engine) -> None:
    """Stops count only for tokens after the first min_new_tokens: text inside the
    window is never matched, text after it is."""
    prompt = "The capital of France is"
    ids, text = greedy(tiny, prompt, 12)
    first = tiny.tokenizer.decode(ids[:1])
    stop = first.strip()[:4]
    assert stop and stop in first
    expected = {0: ("stop_string", first[: first.index(stop)])}
    window = tiny.tokenizer.decode(ids[:2])
    rest = text[len(window):]
    expected[2] = (("stop_string", window + rest[: rest.index(stop)]) if stop in rest
                   else ("max_new_tokens", text))
    for min_new, (reason, completion) in expected.items():
        job = DynamicJob(tiny.tokenizer.encode(prompt), 12, min_new, stop_conditions=[stop], identifier=0)
        (results,) = run(tiny.generator(), [job]).values()
        assert (results[-1]["eos_reason"], results[-1]["full_completion"]) == (reason, completion)
        assert streamed(results) == completion


# --- stop tokens and min_new_tokens, against a transformers greedy loop --------------------


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new: int, min_new: int,
              stops: set[int]) -> tuple[list[int], str]:
    """Documented semantics: stop tokens are banned while fewer than min_new tokens exist,
    and end the job (excluded from the text) once more than min_new tokens exist."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    cache, logits = out.cache, out.logits[0, -1]
    tokens: list[int] = []
    banned = torch.tensor(sorted(stops))
    while True:
        if len(tokens) < min_new:
            logits = logits.clone()
            logits[banned] = float("-inf")
        token = int(logits.argmax())
        tokens.append(token)
        if token in stops and len(tokens) > min_new:
            return tokens, "stop_token"
        if len(tokens) == max_new:
            return tokens, "max_new_tokens"
        out = hf(torch.tensor([[token]]), cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[0, -1]


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_stop_tokens_and_min_new_tokens_match_reference(tiny: Engine, tiny_hf: torch.nn.Module) -> None:
    tok = tiny.tokenizer
    prompt = tok.encode("The capital of France is")
    ids, _ = greedy(tiny, "The capital of France is", 8)
    allowed = tok.encode(" hello")[0]
    everything_but_one = set(range(tiny.model.config.vocab_size)) - {allowed}
    cases = {                                  # name: (stop tokens, min_new_tokens, max_new_tokens)
        "first-token": ({ids[0]}, 0, 8),
        "fourth-token": ({ids[3]}, 0, 8),
        "first-token-banned": ({ids[0]}, 3, 8),
        "stop-at-min-plus-one": (everything_but_one, 3, 8),
    }
    jobs = [DynamicJob(prompt, max_new, min_new, stop_conditions=sorted(stops), identifier=name)
            for name, (stops, min_new, max_new) in cases.items()]
    got = run(tiny.generator(), jobs)
    for name, (stops, min_new, max_new) in cases.items():
        want_ids, want_reason = hf_greedy(tiny_hf, prompt, max_new, min_new, stops)
        results, last = got[name], got[name][-1]
        assert (token_ids(results), last["eos_reason"]) == (want_ids, want_reason), name
        assert not set(want_ids[:min_new]) & stops, name
        text_ids = want_ids[:-1] if want_reason == "stop_token" else want_ids
        assert last["full_completion"] == streamed(results) == tok.decode(text_ids), name
    assert token_ids(got["first-token"]) == [ids[0]] and got["first-token"][-1]["full_completion"] == ""
    assert token_ids(got["fourth-token"]) == ids[:4]
    assert token_ids(got["stop-at-min-plus-one"])[:3] == [allowed] * 3
    assert got["stop-at-min-plus-one"][-1]["new_tokens"] == 4


# --- UTF-8 streaming ----------------------------------------------------------------------


@pytest.mark.slow
def test_utf8_streaming_never_splits_characters(smol: Engine) -> None:
    line = "日本語 🙂🙂 😀 中文字符 👍"
    prompt = "\n".join([line] * 4) + "\n日本"
    tok = smol.tokenizer
    job = DynamicJob(tok.encode(prompt), 24, stop_conditions=["\n"], identifier=0)
    (results,) = run(smol.generator(), [job]).values()
    ids = token_ids(results)
    completion = results[-1]["full_completion"]
    assert results[-1]["eos_reason"] == "stop_string"     # ends on a line break, not mid-character
    # the test means something only if characters really were split over tokens
    assert any(REPLACEMENT_CHAR in tok.decode([t]) for t in ids)
    assert "🙂" in completion and "中文" in completion
    assert completion + "\n" == tok.decode(ids) and REPLACEMENT_CHAR not in completion
    assert streamed(results) == completion
    assert not [r["text"] for r in results if REPLACEMENT_CHAR in r["text"]]
    # a multi-byte stop string inside that text
    stop = "字符"
    assert stop in completion
    job = DynamicJob(tok.encode(prompt), 24, stop_conditions=[stop], identifier=0)
    (results,) = run(smol.generator(), [job]).values()
    assert results[-1]["eos_reason"] == "stop_string"
    assert results[-1]["full_completion"] == streamed(results) == completion[: completion.index(stop)]


# --- seeds ------------------------------------------------------------------------------

SAMPLED = SamplerSettings(temperature=1.0, top_p=0.9)
SEED_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,",
                "Dear Sir or Madam,", "In 1492, Columbus", "The mitochondria is", "SELECT * FROM"]


def sampled_jobs(tok: Tokenizer, order: Sequence[int], seed_offset: int = 0) -> list[DynamicJob]:
    return [DynamicJob(tok.encode(SEED_PROMPTS[i]), 8, gen_settings=SAMPLED, seed=1000 + i + seed_offset,
                       identifier=i) for i in order]


def test_seeded_sampling_is_independent_of_batch_mix(tiny: Engine) -> None:
    tok = tiny.tokenizer
    alone = {i: token_ids(run(tiny.generator(), sampled_jobs(tok, [i]))[i]) for i in (0, 5)}
    together = run(tiny.generator(), sampled_jobs(tok, range(8)))
    shuffled = run(tiny.generator(max_batch_size=3, max_chunk_size=5), sampled_jobs(tok, [7, 2, 5, 0, 3, 6, 1, 4]))
    for i in alone:
        assert token_ids(together[i]) == alone[i]
    for i in range(8):
        assert token_ids(shuffled[i]) == token_ids(together[i])
        assert len(token_ids(together[i])) == 8
    reseeded = run(tiny.generator(), sampled_jobs(tok, range(8), seed_offset=1))
    assert any(token_ids(reseeded[i]) != token_ids(together[i]) for i in range(8))   # the seed matters


# --- result dicts ---------------------------------------------------------------------------

BASE_KEYS = {"job", "identifier", "stage", "eos", "text", "token_ids"}
EOS_KEYS = {"eos_reason", "full_completion", "new_tokens", "prompt_tokens", "cached_tokens",
            "time_enqueued", "time_prefill", "time_generate", "nonfinite_logits",
            "drafted_tokens", "accepted_draft_tokens"}
SCORE_KEYS = {"prompt_logprobs", "prompt_greedy"}              # with score_from (tests/test_prompt_scores.py)
THINK_KEYS = {"thinking_tokens", "thinking_forced"}            # with think_end (tests/test_thinking.py)
EXTRA_KEYS = {"logits", "top_k_tokens", "top_k_probs", "token_probs"}


def test_documented_keys_match_types_module() -> None:
    assert set(GeneratorResult.__annotations__) == BASE_KEYS | EOS_KEYS | EXTRA_KEYS | SCORE_KEYS | THINK_KEYS


@pytest.mark.parametrize("settings", [None, SAMPLED], ids=["greedy", "sampled"])
def test_result_dicts_carry_every_documented_key(tiny: Engine, settings: Optional[SamplerSettings]) -> None:
    tok, vocab = tiny.tokenizer, tiny.model.config.vocab_size
    prompt = tok.encode("The capital of France is")
    job = DynamicJob(prompt, 5, gen_settings=settings, seed=3, identifier="x", return_logits=True,
                     return_top_tokens=4, return_probs=True)
    (results,) = run(tiny.generator(), [job]).values()
    assert len(results) == 5
    for r in results:
        assert set(r) == BASE_KEYS | EXTRA_KEYS | (EOS_KEYS if r["eos"] else set())
        assert r["job"] is job and r["identifier"] == "x" and r["stage"] == "streaming"
        (token,) = r["token_ids"]
        assert r["logits"].shape == (1, vocab) and r["logits"].dtype == torch.float32
        assert len(r["top_k_tokens"]) == len(r["top_k_probs"]) == 1
        assert len(r["top_k_tokens"][0]) == len(r["top_k_probs"][0]) == 4
        probs = r["top_k_probs"][0]
        assert probs == sorted(probs, reverse=True)
        (p,) = r["token_probs"]
        assert 0 < p <= 1
        if settings is None:
            assert token == int(r["logits"][0].argmax()) == r["top_k_tokens"][0][0]
            assert p == pytest.approx(float(torch.softmax(r["logits"][0], -1)[token]), rel=1e-5)
        else:
            assert token in r["top_k_tokens"][0] or p <= probs[-1]
    last = results[-1]
    assert last["eos_reason"] == "max_new_tokens" and last["new_tokens"] == 5
    assert last["prompt_tokens"] == len(prompt) and last["cached_tokens"] == 0
    assert last["full_completion"] == streamed(results) == tok.decode(token_ids(results))
    assert all(last[k] >= 0 for k in ("time_enqueued", "time_prefill", "time_generate"))


def test_plain_results_have_no_extras_and_greedy_paths_agree(tiny: Engine) -> None:
    """The batched greedy fast path and the per-job path (taken with extras) pick the same tokens."""
    prompt = tiny.tokenizer.encode("Once upon a time")
    plain = DynamicJob(prompt, 6, identifier="plain")
    extras = DynamicJob(prompt, 6, identifier="extras", return_probs=True, return_top_tokens=1)
    got = run(tiny.generator(), [plain, extras])
    assert all(not set(r) & EXTRA_KEYS for r in got["plain"])
    assert token_ids(got["plain"]) == token_ids(got["extras"])


# --- generate() and stats() ---------------------------------------------------------------


def test_generate_single_and_list(tiny: Engine) -> None:
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    references = [greedy(tiny, p, 6)[1] for p in prompts]
    generator = tiny.generator()
    one = generator.generate(prompts[0], max_new_tokens=6, stop_conditions=[])
    assert isinstance(one, str) and one == prompts[0] + references[0]
    many = generator.generate(prompts, max_new_tokens=6, stop_conditions=[], completion_only=True)
    assert many == references
    full = generator.generate(prompts, max_new_tokens=6, stop_conditions=[])
    assert full == [p + c for p, c in zip(prompts, references)]


def test_generate_with_per_prompt_settings(tiny: Engine) -> None:
    prompts = ["The capital of France is", "Once upon a time"]
    generator = tiny.generator()
    mixed = generator.generate(prompts, max_new_tokens=8, stop_conditions=[], gen_settings=[None, SAMPLED],
                               seed=7, completion_only=True)
    assert mixed[0] == greedy(tiny, prompts[0], 8)[1]
    # prompt i uses seed + i
    job = DynamicJob(tiny.tokenizer.encode(prompts[1]), 8, gen_settings=SAMPLED, seed=8, identifier=0)
    (results,) = run(tiny.generator(), [job]).values()
    assert mixed[1] == results[-1]["full_completion"]
    with pytest.raises(ValueError, match="gen_settings has 1 entries for 2 prompts"):
        generator.generate(prompts, max_new_tokens=2, gen_settings=[SAMPLED])


def test_generate_default_stops_at_eos(tiny_model_dir: Path, tmp_path: Path) -> None:
    """stop_conditions=None means the tokenizer's EOS ids. On a model rigged so that EOS is
    certain right after a chosen trigger token, generate() ends there; [] runs on past it."""
    tok = Tokenizer.load(tiny_model_dir)
    (eos,) = tok.eos_token_ids
    prompt = "The capital of France is"
    prompt_ids = tok.encode(prompt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rig_eos_trigger(hf, eos)                                  # no trigger yet: EOS logit is 0 everywhere
    free_ids, _ = hf_greedy(hf, prompt_ids, 8, 0, set())
    assert eos not in free_ids
    k = next(i for i in range(3, 8) if free_ids[i - 1] not in prompt_ids + free_ids[: i - 1])
    rig_eos_trigger(hf, eos, trigger_token=free_ids[k - 1])   # EOS right after the k-th new token
    want_ids, _ = hf_greedy(hf, prompt_ids, 8, 0, set())      # no stops: sees past the EOS
    assert want_ids[:k] == free_ids[:k] and want_ids[k] == eos and len(want_ids) == 8
    before, everything = tok.decode(want_ids[:k]), tok.decode(want_ids)
    assert before and everything != before                    # tokens after EOS add text

    engine = Engine(save_tiny_model(hf, tmp_path / "eos-after-trigger", tokenizer_from=tiny_model_dir))
    generator = engine.generator()
    assert generator.generate(prompt, max_new_tokens=8, completion_only=True) == before
    assert generator.generate(prompt, max_new_tokens=8) == prompt + before
    assert generator.generate(prompt, max_new_tokens=8, stop_conditions=[], completion_only=True) == everything
    shown = generator.generate(prompt, max_new_tokens=8, stop_conditions=[], decode_special_tokens=True,
                               completion_only=True)
    assert shown.startswith(before + "<|im_end|>")            # SmolLM2's EOS text, generated and not stopped at
    # the job API reports the reason: the EOS token ends the job as a stop token
    job = DynamicJob(prompt_ids, 8, stop_conditions=tok.eos_token_ids, identifier=0)
    (results,) = run(engine.generator(), [job]).values()
    assert (token_ids(results), results[-1]["eos_reason"]) == (want_ids[: k + 1], "stop_token")
    assert results[-1]["full_completion"] == streamed(results) == before


def test_stats_counts(tiny: Engine) -> None:
    tok = tiny.tokenizer
    prompts = [tok.encode(p) for p in SEED_PROMPTS[:3]]
    generator = tiny.generator()
    run(generator, [DynamicJob(p, 4, identifier=i) for i, p in enumerate(prompts)])
    stats = generator.stats()
    assert set(stats) == set(GeneratorStats.__annotations__)
    assert stats["prompt_tokens"] == stats["prefill_tokens"] == sum(map(len, prompts))
    assert stats["cached_tokens"] == 0
    assert stats["generated_tokens"] == 12
    assert stats["peak_batch_size"] == 3
    assert stats["forward_passes"] == 4          # one prefill forward, then three decode steps
    assert stats["pages_total"] == 4096 // 16 and stats["pages_in_use"] == 0
