"""Cache modes as users size and pick them: bytes per token from the allocated tensors, the
tokens a given memory holds, MMLU under eviction in a quantized cache, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import numpy as np
import pytest
import torch

from evalrun.engine import Model, PagedCache
from evalrun.commands.cli import CACHE_MODE_CHOICES, main
from evalrun.kernels.kv_format import KV_FORMATS

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"
# acceptance: bytes per token relative to fp16 storage, scales included
MAX_RATIO_TO_FP16 = {"q8": 0.54, "q6": 0.42, "q4": 0.29}


@pytest.fixture(scope="module")
def model(tiny_kv32_dir: Path) -> Model:
    return Model.load(tiny_kv32_dir, dtype="float32")


def _allocated_bytes(cache: PagedCache, names: tuple[str, ...] = ("k", "v", "k_scale", "v_scale")) -> int:
    """Counted here from the tensors themselves, not through the cache's own accounting
    (default: the page storage; ("wk", "wv"): the recent-token window store)."""
    seen = {}
    for layer in cache.layers:
        for t in (getattr(layer, name) for name in names):
            if t is not None:
                seen[t.data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
def test_bytes_per_token_from_the_allocated_tensors(model, mode):
    fp16 = PagedCache(model, max_tokens=64 * 16, page_size=16, mode="fp16")
    cache = PagedCache(model, max_tokens=64 * 16, page_size=16, mode=mode)
    slots = (cache.num_pages + 1) * cache.page_size
    window = _allocated_bytes(cache, ("wk", "wv"))
    assert window == cache.window_memory_bytes() > 0          # one exact block per running job
    assert _allocated_bytes(cache) + window == cache.memory_bytes()
    assert cache.bytes_per_token() == _allocated_bytes(cache) / slots
    cfg = model.config
    assert cache.bytes_per_token() == KV_FORMATS[mode].bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    ratio = cache.bytes_per_token() / (_allocated_bytes(fp16) / slots)
    assert ratio <= MAX_RATIO_TO_FP16[mode], ratio
    assert cache.k[0].dtype == torch.uint8 and cache.layers[0].k_scale.dtype == torch.float16


@pytest.mark.parametrize("memory,window", [(4 * 2**20, 0), (16 * 2**20, None)])
def test_same_memory_holds_3_4x_the_tokens_in_q4(model, memory, window):
    """The window store (64 running jobs x one block, fp16) comes out of the same budget: a
    fixed cost that the pages outgrow (at 16 MiB it is 3% of this tiny model's cache)."""
    fp16 = PagedCache(model, page_size=16, mode="fp16", max_memory=memory)
    q4 = PagedCache(model, page_size=16, mode="q4", max_memory=memory, window=window)
    assert q4.window == (16 if window is None else 0)
    assert q4.max_tokens >= 3.4 * fp16.max_tokens, (q4.max_tokens, fp16.max_tokens)
    for cache in (fp16, q4):
        assert cache.memory_bytes() <= memory < cache.memory_bytes() + cache.page_size * cache.bytes_per_token()


@pytest.mark.parametrize("kwargs,needle", [
    ({"mode": "q3"}, "cache mode must be one of"),
    ({"mode": "q4", "max_memory": 100}, "too small"),
    ({"mode": "q4", "max_memory": 2**20, "max_tokens": 1024}, "not both"),
])
def test_bad_cache_settings_are_named(model, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PagedCache(model, page_size=16, **kwargs)


def test_head_dim_not_divisible_by_the_group_is_named(tiny_model_dir):
    model = Model.load(tiny_model_dir, dtype="float32")            # head dimension 16
    with pytest.raises(ValueError, match="head dimension 16 is not divisible by 32"):
        PagedCache(model, max_tokens=256, page_size=16, mode="q8")
    PagedCache(model, max_tokens=256, page_size=16, mode="fp16")  # float storage has no groups


def test_cli_mode_choices_are_the_engine_modes():
    assert set(CACHE_MODE_CHOICES) == {"auto", *KV_FORMATS}


def _mmlu(model_dir: Path, out: Path, *extra: str) -> int:
    try:
        return main(["mmlu", "--model", str(model_dir), "--data-dir", str(FIXTURE), "--output-dir", str(out),
                     "--no-progress", *extra])
    except SystemExit as exc:              # argparse's own errors
        return exc.code


@pytest.mark.parametrize("argv,needle", [
    (["--cache-mode", "q3"], "unknown cache mode 'q3'"),
    (["--cache-memory", "2XB"], "expected a size such as 2GiB"),
    (["--cache-memory", "1GiB", "--cache-tokens", "4096"], "not allowed with argument"),
    (["--cache-mode", "q4", "--cache-memory", "4KiB"], "too small"),
    (["--cache-memory", "1" + "0" * 400], "out of range"),
    (["--cache-memory", "64TiB"], "more than this machine's"),
    (["--cache-tokens", str(2**40)], "more than this machine's"),
])
def test_cli_bad_cache_input_exits_2_naming_it(tiny_kv32_dir, tmp_path, capsys, argv, needle):
    """Exit 2, no traceback, the problem on the last line (argparse prints its usage above)."""
    assert _mmlu(tiny_kv32_dir, tmp_path / "o", "--subjects", "nutrition", "--limit", "1", *argv) == 2
    err = capsys.readouterr().err
    assert needle in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_cli_head_dim_not_divisible_exits_2_before_loading(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Model, "load", lambda *a, **k: pytest.fail("loaded the model before checking"))
    assert _mmlu(tiny_model_dir, tmp_path / "o", "--subjects", "nutrition", "--limit", "1",
                 "--cache-mode", "q6") == 2
    err = capsys.readouterr().err
    assert "head dimension 16 is not divisible by 32" in err and "Traceback" not in err


def test_mmlu_under_eviction_in_q4_predicts_what_a_large_cache_does(tiny_kv32_dir, tmp_path):
    """A --cache-memory small enough that the prompt cache evicts: the same predictions and
    (to float noise) the same choice log-probs as a cache that never evicts."""
    common = ["--subjects", "abstract_algebra,nutrition,philosophy", "--limit", "4", "--page-size", "16",
              "--cache-mode", "q4"]
    large, small = tmp_path / "large", tmp_path / "small"
    assert _mmlu(tiny_kv32_dir, large, *common, "--cache-tokens", "65536") == 0
    # the tiny model: 2 layers x 2 KV heads x (16 + 16 + 2 + 2) bytes = 144 bytes a token
    assert _mmlu(tiny_kv32_dir, small, *common, "--cache-memory", str(144 * 16 * 60)) == 0
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (large, small)]
    # the window store (16 tokens x 2 layers x 2 heads x 32 values x K,V in fp16 = 8 KiB a
    # running job; by default at most 1/16 of the memory: one job here) comes off the budget
    m = manifests[1]
    assert m["cache_window"] == 16 and m["cache_window_bytes_per_job"] == 8192 and m["cache_window_jobs"] == 1
    assert m["cache_tokens"] == 16 * ((144 * 16 * 60 - 8192) // (144 * 16) - 1) < manifests[0]["cache_tokens"]
    assert m["cache_memory_bytes"] <= 144 * 16 * 60
    assert manifests[1]["cache_bytes_per_token"] == 144 and manifests[1]["cache_mode"] == "q4"
    summary = json.loads((small / "summary.json").read_text())
    assert summary["this_session"]["generator"]["pages_evicted"] > 0
    frames = [pd.read_parquet(d / "samples").sort_values(["subject", "doc_id"]) for d in (large, small)]
    assert list(frames[0].prediction) == list(frames[1].prediction)
    a, b = (torch.tensor(np.stack(f.choice_logprobs.tolist())) for f in frames)
    torch.testing.assert_close(a, b, atol=1e-2, rtol=0)


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
def test_bfloat16_model_over_a_quantized_cache(tiny_kv32_dir, mode):
    """bf16 compute reads dequantized K/V in its own dtype. Its first-token logits sit no
    further from the fp32 model's over the same mode than the mode's own error plus bf16's
    own error (measured here: 0.05 / 0.13 / 0.21 against bounds 0.06 / 0.41 / 0.58); a
    mishandled dtype or rotation would be far outside."""
    from engine_helpers import greedy_jobs, make_generator, random_prompts, run_jobs
    m32, m16 = (Model.load(tiny_kv32_dir, dtype=d) for d in ("float32", "bfloat16"))
    prompts = random_prompts(4, [9, 30], m32.config.vocab_size, seed=7)

    def logits(model: Model, cache_mode: str) -> torch.Tensor:
        out = run_jobs(make_generator(model, mode=cache_mode), greedy_jobs(prompts, 1, return_logits=True))
        return torch.cat([out[i]["all_logits"] for i in range(len(prompts))])

    fp32, quant32, quant16 = logits(m32, "fp32"), logits(m32, mode), logits(m16, mode)
    assert torch.isfinite(quant16).all()
    bf16_error = (logits(m16, "bf16") - fp32).abs().mean()
    mode_error = (quant32 - fp32).abs().mean()
    assert (quant16 - quant32).abs().mean() <= mode_error + bf16_error
