"""Bad input fails early with a clear message (the message content is part of the contract)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings, Tokenizer
from evalrun.engine.config import ConfigError
from evalrun.engine.weights import WeightsError

VOCAB = 1000


@pytest.fixture(scope="module")
def small_dir(tiny_model_factory) -> Path:
    """A tiny llama (vocab 1000, max_position_embeddings 64); tests copy it before editing."""
    return tiny_model_factory("llama", vocab_size=VOCAB, max_position_embeddings=64, seed=21)


@pytest.fixture(scope="module")
def small_model(small_dir: Path) -> Model:
    return Model.load(small_dir, dtype="float32")


@pytest.fixture
def model_copy(small_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(small_dir, tmp_path / "model"))


def generator(model: Model, max_tokens: int = 256, page_size: int = 16, **kwargs) -> DynamicGenerator:
    return DynamicGenerator(model, PagedCache(model, max_tokens=max_tokens, page_size=page_size, mode="fp32"),
                            **kwargs)


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# --- jobs -----------------------------------------------------------------------------------


def test_empty_prompt(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="empty prompt: a job needs at least one input token"):
        DynamicJob([], max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        DynamicJob(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)
    model = Model.load(tiny_model_dir, dtype="float32")
    gen = generator(model, tokenizer=Tokenizer.load(tiny_model_dir))
    with pytest.raises(ValueError, match="empty prompt"):
        gen.generate("", max_new_tokens=2)
    assert gen.num_remaining_jobs() == 0


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"max_new_tokens": -3}, "max_new_tokens must be an integer >= 1, got -3"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 1, got 2.5"),
    ({"max_new_tokens": 4, "min_new_tokens": 5}, re.escape("min_new_tokens (5) exceeds max_new_tokens (4)")),
    ({"max_new_tokens": 4, "min_new_tokens": -1}, "min_new_tokens must be an integer >= 0, got -1"),
    ({"max_new_tokens": 4, "return_top_tokens": -1}, "return_top_tokens must be an integer >= 0, got -1"),
])
def test_bad_job_lengths(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicJob([1, 2, 3], **kwargs)


def test_bad_input_ids() -> None:
    with pytest.raises(TypeError, match="input_ids must be a sequence of int token ids"):
        DynamicJob([1.0, 2.0], max_new_tokens=2)
    with pytest.raises(ValueError, match=re.escape("input_ids tensor must be [n] or [1, n], got shape (2, 3)")):
        DynamicJob(torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(TypeError, match="gen_settings must be a SamplerSettings, got dict"):
        DynamicJob([1], max_new_tokens=2, gen_settings={"temperature": 1.0})


def test_prompt_too_long_for_the_model(small_model: Model) -> None:
    gen = generator(small_model, max_tokens=1024)
    with pytest.raises(ValueError, match="prompt too long: 60 prompt tokens \\+ 10 max_new_tokens = 70 tokens "
                                         "exceeds the model's max_seq_len of 64"):
        gen.enqueue(DynamicJob([5] * 60, max_new_tokens=10))
    with pytest.raises(ValueError, match="100 prompt tokens .* exceeds the model's max_seq_len of 64"):
        gen.enqueue(DynamicJob([5] * 100, max_new_tokens=1))
    gen.enqueue(DynamicJob([5] * 60, max_new_tokens=4))          # exactly 64 fits
    assert gen.num_remaining_jobs() == 1


def test_prompt_too_long_for_the_cache(small_model: Model) -> None:
    gen = generator(small_model, max_tokens=32, page_size=16)
    with pytest.raises(ValueError, match="prompt too long: 30 prompt tokens \\+ 10 max_new_tokens = 40 tokens "
                                         "exceeds the cache's 32 tokens"):
        gen.enqueue(DynamicJob([5] * 30, max_new_tokens=10))
    gen.enqueue(DynamicJob([5] * 30, max_new_tokens=2))          # exactly 32 fits
    assert gen.num_remaining_jobs() == 1


def test_failed_enqueue_of_a_list_queues_nothing(small_model: Model) -> None:
    gen = generator(small_model)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        gen.enqueue([DynamicJob([1, 2], 2), DynamicJob([1, VOCAB], 2)])
    assert gen.num_remaining_jobs() == 0


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 5, -1])
def test_prompt_token_outside_vocab(small_model: Model, bad: int) -> None:
    gen = generator(small_model)
    with pytest.raises(ValueError, match=re.escape(f"token id {bad} is outside the model's vocabulary [0, {VOCAB})")):
        gen.enqueue(DynamicJob([1, 2, bad], max_new_tokens=2))


def test_stop_token_outside_vocab_is_rejected_at_enqueue(small_model: Model) -> None:
    gen = generator(small_model)
    job = DynamicJob([1, 2, 3], max_new_tokens=4, min_new_tokens=2, stop_conditions=[VOCAB + 7])
    with pytest.raises(ValueError, match=f"stop token id {VOCAB + 7} .*vocabulary"):
        gen.enqueue(job)


def test_stop_conditions_and_tokenizer_requirements(small_model: Model) -> None:
    with pytest.raises(ValueError, match="a stop token id must be >= 0, got -2"):
        DynamicJob([1], 2, stop_conditions=[-2])
    with pytest.raises(ValueError, match="a stop string must not be empty"):
        DynamicJob([1], 2, stop_conditions=[""])
    with pytest.raises(ValueError, match="not a single str 'stop'"):
        DynamicJob([1], 2, stop_conditions="stop")
    with pytest.raises(ValueError, match="a stop condition must be a token id \\(int\\) or a string, got float 1.5"):
        DynamicJob([1], 2, stop_conditions=[1.5])
    with pytest.raises(ValueError, match="stop strings need a tokenizer; pass tokenizer= to DynamicGenerator"):
        generator(small_model).enqueue(DynamicJob([1], 2, stop_conditions=["\n"]))


def test_enqueue_a_finished_job_again(small_model: Model) -> None:
    gen = generator(small_model)
    job = DynamicJob([1, 2, 3], max_new_tokens=2)
    gen.enqueue(job)
    while gen.num_remaining_jobs():
        gen.iterate()
    with pytest.raises(ValueError, match="this DynamicJob was already enqueued; create a new one"):
        gen.enqueue(job)
    with pytest.raises(TypeError, match="enqueue takes DynamicJob objects, got list"):
        gen.enqueue([[1, 2, 3]])


@pytest.mark.parametrize("how", ["twice-in-one-list", "two-calls"])
def test_enqueue_the_same_job_twice(small_model: Model, how: str) -> None:
    gen = generator(small_model)
    job = DynamicJob([1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="already enqueued"):
        if how == "two-calls":
            gen.enqueue(job)
            gen.enqueue(job)
        else:
            gen.enqueue([job, job])


def test_generate_needs_a_tokenizer_and_an_idle_generator(tiny_model_dir: Path) -> None:
    model = Model.load(tiny_model_dir, dtype="float32")
    with pytest.raises(ValueError, match="generate\\(\\) needs a tokenizer; pass tokenizer= to DynamicGenerator"):
        generator(model).generate("hello", max_new_tokens=2)
    gen = generator(model, tokenizer=Tokenizer.load(tiny_model_dir))
    gen.enqueue(DynamicJob([1, 2, 3], max_new_tokens=2))
    with pytest.raises(RuntimeError, match="generate\\(\\) needs an idle generator"):
        gen.generate("hello", max_new_tokens=2)
    gen.iterate()
    assert gen.num_remaining_jobs() == 1
    with pytest.raises(RuntimeError, match="defragment needs an idle generator"):
        gen.defragment()


# --- sampler settings ----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1}, "temperature must be a finite number >= 0 \\(0 = greedy\\), got -1"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"top_p": 0}, "top_p must be a number in \\(0, 1\\] \\(1 = off\\), got 0"),
    ({"top_p": 1.5}, "top_p must be a number in \\(0, 1\\] \\(1 = off\\), got 1.5"),
    ({"top_k": -1}, "top_k must be an integer >= 0 \\(0 = off\\), got -1"),
    ({"top_k": 2.0}, "top_k must be an integer >= 0 \\(0 = off\\), got 2.0"),
    ({"min_p": 1.0}, "min_p must be a number in \\[0, 1\\) \\(0 = off\\), got 1.0"),
    ({"token_repetition_penalty": 0}, "token_repetition_penalty must be a finite number > 0 \\(1 = off\\), got 0"),
    ({"token_frequency_penalty": float("inf")}, "token_frequency_penalty must be a finite number"),
])
def test_invalid_sampler_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplerSettings(**kwargs)


# --- generator and cache construction --------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"mode": "int8"}, "cache mode must be one of fp32, bf16, fp16, q8, q6, q4, got 'int8'"),
    ({"mode": "float32"}, "cache mode must be one of fp32, bf16, fp16, q8, q6, q4, got 'float32'"),
    ({"page_size": 0}, "page_size must be a positive integer, got 0"),
    ({"page_size": 16.0}, "page_size must be a positive integer, got 16.0"),
    ({"page_size": 256, "max_tokens": 100}, "max_tokens \\(100\\) must be an integer >= page_size \\(256\\)"),
])
def test_bad_cache_arguments(small_model: Model, kwargs: dict, message: str) -> None:
    args = {"max_tokens": 1024, "page_size": 16, "mode": "fp32", **kwargs}
    with pytest.raises(ValueError, match=message):
        PagedCache(small_model, **args)


@pytest.mark.parametrize("kwargs,message", [
    ({"max_batch_size": 0}, "max_batch_size must be None or an integer >= 1, got 0"),
    ({"max_chunk_size": 0}, "max_chunk_size must be an integer >= 1, got 0"),
])
def test_bad_generator_arguments(small_model: Model, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generator(small_model, **kwargs)


def test_tokenizer_model_vocab_mismatch(small_model: Model, smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.load(smollm2_dir)
    with pytest.raises(ValueError, match=f"tokenizer/model vocab mismatch: the tokenizer has {tokenizer.vocab_size} "
                                         f"tokens, the model's embedding only {VOCAB}"):
        generator(small_model, tokenizer=tokenizer)
    assert tokenizer.vocab_size == 49152


# --- loading --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "float64", "bf16", "torch.float32"])
def test_invalid_dtype_string(small_dir: Path, dtype: str) -> None:
    with pytest.raises(ValueError, match=f"dtype must be one of float32, bfloat16, float16, got '{dtype}'"):
        Model.load(small_dir, dtype=dtype)


def test_missing_model_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=f"model directory not found: {re.escape(str(missing))}"):
        Model.load(missing, dtype="float32")


def test_dir_without_config(model_copy: Path) -> None:
    (model_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"no config.json in model directory {re.escape(str(model_copy))}"):
        Model.load(model_copy, dtype="float32")


def test_config_that_is_not_json(model_copy: Path) -> None:
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        Model.load(model_copy, dtype="float32")


def test_config_without_weights(model_copy: Path) -> None:
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in .*: expected model.safetensors or "
                                                "model.safetensors.index.json"):
        Model.load(model_copy, dtype="float32")


def test_unsupported_architecture(model_copy: Path) -> None:
    edit_config(model_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError, match="unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM, "
                                          "MistralForCausalLM, Qwen2ForCausalLM"):
        Model.load(model_copy, dtype="float32")


def test_unsupported_hidden_act(model_copy: Path) -> None:
    edit_config(model_copy, hidden_act="gelu")
    with pytest.raises(ConfigError, match="unsupported hidden activation 'gelu'; supported: silu, gelu_pytorch_tanh"):
        Model.load(model_copy, dtype="float32")


@pytest.mark.parametrize("changes,message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
     "unsupported rope scaling type 'yarn'; supported: default, linear, llama3, longrope"),
    ({"num_key_value_heads": 3}, "num_attention_heads \\(4\\) is not a multiple of num_key_value_heads \\(3\\)"),
    ({"vocab_size": 0}, "config field vocab_size must be a positive integer, got 0"),
])
def test_unservable_config(model_copy: Path, changes: dict, message: str) -> None:
    edit_config(model_copy, **changes)
    with pytest.raises(ConfigError, match=message):
        Model.load(model_copy, dtype="float32")


def test_weight_with_wrong_shape(model_copy: Path) -> None:
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :100].contiguous()                  # [64, 128] -> [64, 100]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=re.escape(f"tensor '{name}' has shape (64, 100), config implies (64, 128)")):
        Model.load(model_copy, dtype="float32")


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight", "lm_head.weight"])
def test_missing_tensor(model_copy: Path, name: str) -> None:
    """A dropped layer tensor, or the LM head of an untied model."""
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=re.escape(f"weights lack tensor '{name}'")):
        Model.load(model_copy, dtype="float32")


def test_index_naming_a_missing_shard(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama", sharded=True, seed=22)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (model_dir / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"names shard files that are missing: {re.escape(shard)}"):
        Model.load(model_dir, dtype="float32")


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA message")
def test_cuda_device_without_cuda(small_dir: Path) -> None:
    with pytest.raises(ValueError, match="device 'cuda' requested but CUDA is not available"):
        Model.load(small_dir, dtype="float32", device="cuda")



def test_running_out_of_memory_mid_run_is_one_line_and_keeps_the_rows(tiny_model_dir: Path, tmp_path: Path,
                                                                      monkeypatch, capsys) -> None:
    """A memory failure after the model loaded (issue 43): exit 1, one line, the rows scored before it kept,
    and the same command resumes."""
    from evalrun.commands.cli import main
    from evalrun.results import read_samples
    from evalrun.tasks.mmlu import MMLUTask

    fixture = Path(__file__).resolve().parent / "data" / "mmlu"
    argv = ["mmlu", "--no-progress", "--model", str(tiny_model_dir), "--data-dir", str(fixture), "--subjects",
            "nutrition", "--limit", "6", "--dtype", "float32", "--flush-rows", "1", "--output-dir", str(tmp_path / "r")]
    real, seen = MMLUTask.score, []

    def score(self, plan, answers):
        seen.append(plan.doc_key)
        if len(seen) == 4:
            raise MemoryError("Cannot allocate memory")
        return real(self, plan, answers)
    monkeypatch.setattr(MMLUTask, "score", score)
    capsys.readouterr()
    assert main(argv) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "out of memory while running (MemoryError" in errors[0]
    monkeypatch.setattr(MMLUTask, "score", real)
    assert main(argv) == 0
    assert len(read_samples(tmp_path / "r")) == 6
