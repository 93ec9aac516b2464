"""GGUF files as --model (issue 40): tiny random-weight models made by transformers, written to GGUF
in the test (tests/gguf_writer.py, as llama.cpp's converter writes them: F32, F16, Q8_0 and the
k-quants Q4_K, Q5_K, Q6_K), loaded by evalrun and by transformers' own GGUF loading
(`from_pretrained(dir, gguf_file=...)`), compared at every prompt position.

The demo model's own llama.cpp release file (Q4_1) against transformers too. Then the tokenizer
(ids equal transformers' GGUF tokenizer), `evalrun mmlu --model x.gguf` with
the manifest's sha256 and quantization, llama3 rope scaling from `rope_freqs`, and bad files:
missing, truncated, not GGUF, an unsupported architecture, experts, a missing, misshapen or
unused tensor: each one line, exit 2 on the CLI.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from evalrun.commands.cli import main
from evalrun.demo import find_demo_gguf
from evalrun.engine import Model, Tokenizer
from evalrun.engine.config import ConfigError
from evalrun.engine.weights import WeightsError
from tests.test_model import SMOLLM2_TOL, _prefill_forward, hf_logits, load_hf, max_diff, random_prompt
from tests.tiny_models import LLAMA3_ROPE, make_tiny_model

transformers = pytest.importorskip("transformers")
gguf_writer = pytest.importorskip("tests.gguf_writer")      # needs the gguf package

FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"
# k-quant rows are 256 values: every matrix's input width is a multiple of 256
SIZES = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
SMALL_VOCAB = 1024
# F32 and quantized files alike: the weights are asserted bitwise equal to transformers' (both
# de-quantize the same bits), so what is left is float32 arithmetic (measured up to 5e-5 here)
TOL = 1e-4
# name: (arch, make_tiny_model extras, matrices' type, token embedding's type)
CASES = {
    "llama-f32": ("llama", {}, "F32", None),
    "llama-tied-q4_k": ("llama", {"tie_word_embeddings": True}, "Q4_K", "Q8_0"),
    "qwen2-q8_0": ("qwen2", {}, "Q8_0", None),
    "qwen3-q6_k": ("qwen3", {"head_dim": 128}, "Q6_K", "F16"),    # transformers' qwen3 GGUF config: head_dim 128
    "llama-q5_k": ("llama", {}, "Q5_K", "BF16"),
}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    """One directory of GGUF files (transformers' gguf_file= names a file in a directory)."""
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def tokenizer_fields() -> dict:
    return gguf_writer.read_tokenizer_fields(find_demo_gguf())


def _tiny_gguf(gguf_dir: Path, name: str, tokenizer: dict | None = None, stem: str | None = None) -> Path:
    """CASES[name] as `{stem or name}.gguf` (its HF directory beside it as `hf-{stem or name}`)."""
    arch, extra, qtype, embed = CASES[name]
    stem = stem or name
    vocab = SMALL_VOCAB if tokenizer is None else len(tokenizer["tokenizer.ggml.tokens"])
    model_dir = make_tiny_model(gguf_dir / f"hf-{stem}", arch, seed=7, vocab_size=vocab, **SIZES, **extra)
    return gguf_writer.write_gguf(model_dir, gguf_dir / f"{stem}.gguf", qtype, tokenizer, embed_qtype=embed)


def _hf_gguf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers_gguf_loading(gguf_dir, name: str) -> None:
    path = _tiny_gguf(gguf_dir, name)
    model = Model.load(path, dtype="float32")
    hf = _hf_gguf(path)
    # the same bits de-quantized the same way, q and k un-permuted as transformers does
    hf_weights = hf.state_dict()
    assert torch.equal(model.embed, hf_weights["model.embed_tokens.weight"])
    for i, layer in enumerate(model.layers):
        qkv = torch.cat([hf_weights[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = torch.cat([hf_weights[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(layer.wqkv.weight, qkv) and torch.equal(layer.w_gate_up.weight, gate_up)
    prompts = [random_prompt(n, SMALL_VOCAB, seed=n) for n in (20, 90)]
    got, _ = _prefill_forward(model, prompts, None, page_size=16)
    want = torch.cat([hf_logits(hf, p) for p in prompts])
    assert got.shape == want.shape
    assert max_diff(got, want) <= TOL, name


def test_smollm2_release_file_equals_transformers() -> None:
    """The demo model's own llama.cpp file (Q4_1 and Q8_0 blocks, 9 query and 3 KV heads, 30 layers)."""
    path = find_demo_gguf()
    model, tokenizer = Model.load(path, dtype="float32"), Tokenizer.load(path)
    prompts = [tokenizer.encode(t) for t in ("The capital of France is Paris, and the capital of Germany is",
                                             "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)")]
    got, _ = _prefill_forward(model, prompts, None, page_size=16)
    hf = _hf_gguf(path)
    want = torch.cat([hf_logits(hf, p) for p in prompts])
    assert max_diff(got, want) <= SMOLLM2_TOL


def test_llama3_rope_from_rope_freqs(gguf_dir) -> None:
    """llama.cpp stores llama3 rope scaling as per-frequency factors; transformers' GGUF loading
    ignores them, so the reference is the HF directory the file was written from."""
    model_dir = make_tiny_model(gguf_dir / "hf-llama3", "llama", seed=9, vocab_size=SMALL_VOCAB, **SIZES,
                                rope_scaling=LLAMA3_ROPE)
    path = gguf_writer.write_gguf(model_dir, gguf_dir / "llama3.gguf", "F32")
    model = Model.load(path, dtype="float32")
    assert model.config.rope.rope_type == "llama3" and model.config.rope.factor == 8.0
    prompts = [random_prompt(300, SMALL_VOCAB, seed=3)]
    got, _ = _prefill_forward(model, prompts, None, page_size=16)
    assert max_diff(got, hf_logits(load_hf(model_dir), prompts[0])) <= TOL


@pytest.fixture(scope="module")
def chat_gguf(gguf_dir, tokenizer_fields) -> Path:
    """A Q8_0 tiny llama with SmolLM2's whole tokenizer (vocabulary, merges, chat template)."""
    return _tiny_gguf(gguf_dir, "qwen2-q8_0", tokenizer_fields, stem="chat-qwen2-q8_0")


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(chat_gguf) -> None:
    ours = Tokenizer.load(chat_gguf)
    ref = transformers.AutoTokenizer.from_pretrained(chat_gguf.parent, gguf_file=chat_gguf.name)
    texts = ["Hello world", "  leading spaces and\ttabs\n\nnew lines", "Café 東京 🙂 — ok?", "x = f(3) + 12345",
             "The answer is <|im_end|> here"]
    for text in texts:
        assert ours.encode(text) == ref(text, add_special_tokens=False, split_special_tokens=True).input_ids, text
        assert ours.encode(text, encode_special_tokens=True) == ref(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ours.encode(text)) == ref.decode(ref(text, add_special_tokens=False).input_ids)
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                         add_generation_prompt=True)


def _cli(*args: str) -> int:
    return main(["mmlu", "--no-progress", "--dtype", "float32", "--cache-mode", "fp32", *args])


def test_mmlu_cli_runs_a_gguf_and_records_it(chat_gguf, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert _cli("--model", str(chat_gguf), "--data-dir", str(FIXTURE), "--subjects", "nutrition", "--limit", "2",
                "--output-dir", str(out)) == 0
    assert "overall" in capsys.readouterr().out
    record = json.loads((out / "manifest.json").read_text())["model"]["gguf"]
    assert record["sha256"] == hashlib.sha256(chat_gguf.read_bytes()).hexdigest()
    assert record["bytes"] == chat_gguf.stat().st_size and record["architecture"] == "qwen2"
    assert record["file_type"] == "Q8_0"
    assert record["tensor_types"] == {"F32": 2 * 5 + 1, "Q8_0": 2 * 7 + 2}   # norms, q/k/v biases; matrices


def _bad_file_message(path: Path, tmp_path: Path, capsys) -> str:
    """The one error line of `evalrun mmlu --model path` (exit 2)."""
    assert _cli("--model", str(path), "--data-dir", str(FIXTURE), "--subjects", "nutrition", "--limit", "1",
                "--output-dir", str(tmp_path / f"run-{path.stem}")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1, err
    return errors[0]


def test_bad_gguf_files_exit_2(gguf_dir, tmp_path, capsys) -> None:
    good = gguf_dir / "llama-f32.gguf"
    if not good.is_file():
        _tiny_gguf(gguf_dir, "llama-f32")
    assert "GGUF file not found" in _bad_file_message(tmp_path / "missing.gguf", tmp_path, capsys)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "cut.gguf: a damaged GGUF file, probably truncated" in _bad_file_message(cut, tmp_path, capsys)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("not a model\n" * 100)
    assert "text.gguf: not a GGUF file" in _bad_file_message(not_gguf, tmp_path, capsys)
    model_dir = gguf_dir / "hf-llama-f32"
    phi = gguf_writer.write_gguf(model_dir, tmp_path / "phi.gguf", "F32", arch="phi3")
    assert "GGUF architecture 'phi3' is not supported" in _bad_file_message(phi, tmp_path, capsys)


def test_refusals_name_the_file_and_the_cause(gguf_dir, tmp_path) -> None:
    model_dir = gguf_dir / "hf-llama-f32"
    if not model_dir.is_dir():
        _tiny_gguf(gguf_dir, "llama-f32")
    experts = gguf_writer.write_gguf(model_dir, tmp_path / "moe.gguf", "F32", metadata={"expert_count": 8})
    with pytest.raises(ConfigError, match="num_local_experts=8"):
        Model.load(experts, dtype="float32")
    missing = gguf_writer.write_gguf(model_dir, tmp_path / "missing.gguf", "F32",
                                     drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(WeightsError, match=r"no tensor 'blk\.1\.ffn_up\.weight'"):
        Model.load(missing, dtype="float32")
    extra = {"model.layers.0.self_attn.o_proj.weight": np.zeros((256, 128), np.float32)}
    misshapen = gguf_writer.write_gguf(model_dir, tmp_path / "shape.gguf", "F32", extra_tensors=extra)
    with pytest.raises(WeightsError, match=r"'blk\.0\.attn_output\.weight' has shape \(256, 128\)"):
        Model.load(misshapen, dtype="float32")
    unused = gguf_writer.write_gguf(model_dir, tmp_path / "unused.gguf", "F32",
                                    extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)})
    with pytest.raises(WeightsError, match=r"tensors evalrun does not use \(blk\.0\.attn_sinks\.weight\)"):
        Model.load(unused, dtype="float32")
