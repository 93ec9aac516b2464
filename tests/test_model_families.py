"""Model families against transformers (issue 40): tiny random-weight models that transformers
builds in the test, every 1-D weight (norm gains, biases) randomised so a dropped one shows, fp32.

Per family: logits at every prompt position (prompts longer than the sliding window for the
windowed ones) within 1e-4 of transformers, with the native kernels and with the torch
references; 32 greedy tokens of 4 prompts batched equal transformers' own greedy loop and each
prompt run alone; every cache mode runs. Then what must be refused, before any weight is read.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from evalrun.engine import Model
from evalrun.engine.config import ConfigError, ModelConfig
from evalrun.kernels.backend import TorchKernels
from tests.engine_helpers import greedy_jobs, make_generator, run_jobs
from tests.test_model import TINY_TOL, _prefill_forward, engine_logits, load_hf, max_diff, random_prompt

transformers = pytest.importorskip("transformers")

WINDOW = 24
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
                               "attention_bias": True}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    # transformers' defaults: soft-capping 50 / 30, query_pre_attn_scalar 256, alternating sliding layers
    "gemma2": ("gemma2", {"sliding_window": WINDOW}),
    "gemma2-caps": ("gemma2", {"sliding_window": WINDOW, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
                               "query_pre_attn_scalar": 24, "attention_bias": True}),
    "gemma3": ("gemma3", {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                          "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "olmo2": ("olmo2", {"attention_bias": True}),
    # partial rotary, longrope (its short factors and attention factor: max/original = 8), a window
    "phi3": ("phi3", {"partial_rotary_factor": 0.75, "max_position_embeddings": 4096,
                      "original_max_position_embeddings": 512, "sliding_window": 40,
                      "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(12)],
                                       "long_factor": [4.0] * 12}}),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    from tests.tiny_models import make_tiny_model
    # head_dim 32 (hidden 128, 4 heads): a size the quantized cache modes store
    return {name: make_tiny_model(tmp_path_factory.mktemp(f"family-{name}"), arch, seed=21, hidden_size=128,
                                  extra_config=extra)
            for name, (arch, extra) in FAMILIES.items()}


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: list[int], positions: Optional[list[int]] = None) -> torch.Tensor:
    """transformers' logits [len(positions), V] (default: every position) through the model's own
    forward (Gemma's final soft-capping included)."""
    logits = hf(torch.tensor([list(ids)])).logits[0].float()
    return logits if positions is None else logits[list(positions)]


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, one full forward per token (no cache: the plainest reference)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_at_every_position_match_transformers(family_dirs, family: str, backend: str) -> None:
    model = Model.load(family_dirs[family], dtype="float32", kernels=TorchKernels() if backend == "torch" else None)
    hf = load_hf(family_dirs[family])
    prompts = [random_prompt(n, model.config.vocab_size, seed=n) for n in (20, 90, 300)]
    got, _ = _prefill_forward(model, prompts, None, page_size=16)
    want = torch.cat([hf_logits(hf, p) for p in prompts])
    assert got.shape == want.shape
    assert max_diff(got, want) <= TINY_TOL, family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_batched_equals_transformers_and_alone(family_dirs, family: str) -> None:
    """32 greedy tokens of 4 prompts in one generator (prefill chunks, then decode steps past the
    window) equal transformers' greedy tokens, and each prompt run alone gives the same tokens and
    logits to float noise."""
    model = Model.load(family_dirs[family], dtype="float32")
    hf = load_hf(family_dirs[family])
    prompts = [random_prompt(n, model.config.vocab_size, seed=500 + n) for n in (20, 37, 70, 101)]
    batched = run_jobs(make_generator(model), greedy_jobs(prompts, 32, return_logits=True))
    for i, prompt in enumerate(prompts):
        assert batched[i]["all_token_ids"] == hf_greedy(hf, prompt, 32), (family, i)
        alone = run_jobs(make_generator(model), greedy_jobs([prompt], 32, return_logits=True))[0]
        assert alone["all_token_ids"] == batched[i]["all_token_ids"]
        assert max_diff(alone["all_logits"], batched[i]["all_logits"]) <= 2e-5


# KL(transformers' float32 || ours) bound per cache mode at the last prompt position: tiny random
# models have sharp logits (std ~3), so 4- and 6-bit values move them far more than a real model's
MODE_KL = {"fp32": 1e-6, "bf16": 1e-3, "fp16": 1e-4, "q8": 5e-3, "q6": 0.5, "q4": 0.5}


@pytest.mark.parametrize("mode", list(MODE_KL))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_cache_mode_runs(family_dirs, family: str, mode: str) -> None:
    """Each cache mode (quantized ones with their recent-token window) serves the windowed and the
    q/k-normed model: over prompts longer than the window, the native kernels give the torch
    references' logits in the same mode, and the mode's distribution stays near transformers'."""
    model = Model.load(family_dirs[family], dtype="float32")
    reference = Model.load(family_dirs[family], dtype="float32", kernels=TorchKernels())
    hf = load_hf(family_dirs[family])
    prompts = [random_prompt(n, model.config.vocab_size, seed=700 + n) for n in (30, 75, 130)]
    got = engine_logits(model, prompts, page_size=16, mode=mode)
    ref = engine_logits(reference, prompts, page_size=16, mode=mode)
    for prompt, ours, theirs in zip(prompts, got, ref):
        assert max_diff(ours, theirs) <= (2e-5 if mode == "fp32" else 1e-2), (family, mode, len(prompt))
        want = hf_logits(hf, prompt, [len(prompt) - 1])[0].log_softmax(-1)
        kl = float(torch.sum(want.exp() * (want - ours.log_softmax(-1))))
        assert kl <= MODE_KL[mode], (family, mode, len(prompt), kl)


def test_the_window_matters(family_dirs, tmp_path) -> None:
    """Served with its window dropped, the windowed model's logits past the window move well
    beyond float noise (so the comparisons above could fail)."""
    src = family_dirs["mistral-window"]
    full = tmp_path / "no-window"
    full.mkdir()
    for f in src.iterdir():
        shutil.copyfile(f, full / f.name)           # (a model's files may not be links: engine/model_files.py)
    raw = json.loads((src / "config.json").read_text())
    (full / "config.json").unlink()
    (full / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    prompt = random_prompt(80, raw["vocab_size"], seed=3)
    windowed = engine_logits(Model.load(src, dtype="float32"), [prompt])[0]
    plain = engine_logits(Model.load(full, dtype="float32"), [prompt])[0]
    assert Model.load(full, dtype="float32").config.layer_windows == ()
    assert max_diff(windowed, plain) > 1e-2


def test_a_long_window_model_keeps_its_context(family_dirs) -> None:
    """A sliding window is attention, not a context cap: max_seq_len stays max_position_embeddings."""
    cfg = ModelConfig.load(family_dirs["mistral-window"])
    assert cfg.layer_windows == (WINDOW,) * cfg.num_layers and cfg.max_seq_len == 2048
    qwen = ModelConfig.load(family_dirs["qwen2-window"])
    assert qwen.layer_windows == (0,) + (WINDOW,) * (qwen.num_layers - 1)      # from max_window_layers on


def test_longrope_serves_the_context_of_its_short_factors(family_dirs) -> None:
    """Phi-3's longrope: the short factors and the attention factor of max/original = 8, over the
    original context (what transformers computes for every sequence that long); partial rotary."""
    cfg = ModelConfig.load(family_dirs["phi3"])
    assert cfg.rope.rope_type == "longrope" and cfg.max_seq_len == 512 and cfg.rope_dim == 24
    assert abs(cfg.rope.attention_factor - (1 + 3 / 9) ** 0.5) < 1e-12      # sqrt(1 + ln 8 / ln 512)


def test_plan_names_the_windowed_layers_kernels(family_dirs) -> None:
    model = Model.load(family_dirs["mistral-window"], dtype="float32")
    from evalrun.engine import PagedCache
    names = PagedCache(model, max_tokens=256, page_size=16, mode="fp32").kernels.names
    assert names["variant_decode_attention"] == names["decode_attention"]
    assert names["variant_prefill_attention"] == names["prefill_attention"]
    from evalrun.kernels.cpu import fused, paged_decode, paged_prefill
    if paged_decode.available() and paged_prefill.available():      # the native kernels run them here
        assert names["variant_decode_attention"] == names["variant_prefill_attention"] == "native-c"
    gemma = PagedCache(Model.load(family_dirs["gemma2"], dtype="float32"), max_tokens=256, page_size=16).kernels.names
    assert gemma["gate_up_gelu"] == ("native-c gelu_tanh" if fused.available() else "torch")
    assert "variant_decode_attention" not in PagedCache(Model.load(family_dirs["qwen3"], dtype="float32"),
                                                        max_tokens=256, page_size=16).kernels.names


# --- refused before any weight is read ----------------------------------------------------------------
BASE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64}
REFUSED = {
    "mixtral": ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}, "mixture-of-experts"),
    "qwen3-moe": ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}, "mixture-of-experts"),
    "deepseek-v3": ({"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}, "latent attention"),
    "gemma3-multimodal": ({"architectures": ["Gemma3ForConditionalGeneration"]}, "multimodal"),
    "experts-in-a-llama-config": ({"architectures": ["LlamaForCausalLM"], "num_local_experts": 4}, "num_local_experts"),
    "softcapping": ({"architectures": ["LlamaForCausalLM"], "final_logit_softcapping": 30.0},
                    "final_logit_softcapping"),
    "partial-rotary": ({"architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "unknown-layer-type": ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
                            "layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
    "unknown-architecture": ({"architectures": ["GPTNeoXForCausalLM"]}, "unsupported architecture"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_with_one_line_before_weights(tmp_path, case: str) -> None:
    raw, words = REFUSED[case]
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **raw}))     # no weights at all
    with pytest.raises(ConfigError) as err:
        Model.load(tmp_path, dtype="float32")
    message = str(err.value)
    assert words in message and "\n" not in message


# --- through `evalrun mmlu` (the "Why" cases of issue 40) --------------------------------------------
@pytest.mark.parametrize("family,extra", [("llama", {"attention_bias": True, "mlp_bias": True}),
                                          ("mistral", {"sliding_window": 64})])
def test_mmlu_predictions_equal_transformers(tmp_path, smollm2_dir, family: str, extra: dict[str, Any]) -> None:
    """A biased Llama (its o_proj and MLP biases once dropped silently) and a Mistral whose 5-shot
    prompts outgrow its window of 64 (once capped at the window: every question skipped) through
    the CLI: every question scored, each prediction transformers' argmax over the letters."""
    from evalrun.commands.cli import main
    from evalrun.engine import Tokenizer
    from evalrun.tasks.mmlu import build_prompt
    from evalrun.tasks.mmlu_data import load_mmlu
    from tests.test_mmlu import FIXTURE
    from tests.tiny_models import make_tiny_model
    model_dir = make_tiny_model(tmp_path / "model", family, seed=5, extra_config=extra, tokenizer_from=smollm2_dir)
    out = tmp_path / "run"
    assert main(["mmlu", "--no-progress", "--dtype", "float32", "--cache-mode", "fp32", "--model", str(model_dir),
                 "--data-dir", str(FIXTURE), "--subjects", "nutrition,philosophy", "--limit", "3",
                 "--output-dir", str(out)]) == 0
    import pandas as pd
    rows = pd.read_parquet(out / "samples.parquet")
    assert len(rows) == 6 and not rows.skipped.any()
    data, tok, hf = load_mmlu(FIXTURE), Tokenizer.load(model_dir), load_hf(model_dir)
    letters = [tok.encode(" " + L)[0] for L in "ABCD"]
    docs = {(d.subject, d.doc_id): d for subject in ("nutrition", "philosophy") for d in data.test[subject]}
    for row in rows.itertuples():
        doc = docs[(row.subject, row.doc_id)]
        ids = tok.encode(build_prompt(doc.subject, data.dev[doc.subject][: row.num_fewshot_used], doc))
        assert len(ids) > 64
        lp = hf_logits(hf, ids, [len(ids) - 1])[0].log_softmax(-1)[letters]
        assert row.prediction == "ABCD"[int(lp.argmax())]
        torch.testing.assert_close(torch.tensor(list(row.choice_logprobs), dtype=torch.float32), lp, atol=1e-4, rtol=0)


def test_both_config_spellings_give_one_config(family_dirs) -> None:
    """The transformers 5 spelling (rope_parameters, per layer type for Gemma 3) and the older one
    (rope_theta, rope_scaling, rope_local_base_freq; Phi-3's "su") read as the same config."""
    for family, old_keys in (("gemma3", {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
                             ("phi3", {"rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                       "rope_scaling": {"type": "su", "short_factor": [1.0 + 0.1 * i for i in range(12)],
                                                        "long_factor": [4.0] * 12}})):
        raw = json.loads((family_dirs[family] / "config.json").read_text())
        new = ModelConfig.from_dict(raw)
        old = ModelConfig.from_dict({**{k: v for k, v in raw.items() if k != "rope_parameters"}, **old_keys})
        assert old == new, family


SPARSE = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128, "bos_token_id": 1, "eos_token_id": 2}
SPARSE_CASES = {
    "LlamaForCausalLM": ("LlamaConfig", {}), "MistralForCausalLM": ("MistralConfig", {}),
    "Qwen2ForCausalLM": ("Qwen2Config", {"use_sliding_window": True, "num_hidden_layers": 30}),
    "Qwen3ForCausalLM": ("Qwen3Config", {}), "Gemma2ForCausalLM": ("Gemma2Config", {}),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", {}), "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "Phi3ForCausalLM": ("Phi3Config", {"max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}),
}


@pytest.mark.parametrize("arch", list(SPARSE_CASES))
def test_a_sparse_config_takes_transformers_defaults(arch: str) -> None:
    """A config.json that leaves keys out reads as transformers' configuration class completes it
    (windows, soft-capping, head_dim, eps, context of each family), not with generic defaults."""
    name, extra = SPARSE_CASES[arch]
    sparse = {**SPARSE, **extra}
    full = getattr(transformers, name)(**sparse).to_dict()
    assert ModelConfig.from_dict({**sparse, "architectures": [arch]}) == \
        ModelConfig.from_dict({**full, "architectures": [arch]})
