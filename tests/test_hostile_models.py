"""Untrusted model directories (issue 43, class 5): every hostile config.json, tokenizer file, weights
file, GGUF file or chat template ends `evalrun mmlu` with one line on stderr and exit 2, no
traceback, within 10 s (SIGKILL after) and under 1 GB of peak RSS (the child's own ru_maxrss, from
os.wait4); files are read with O_NOFOLLOW semantics (a link out of the model directory is refused,
a hub cache's links into its own blobs/ are not); a memory failure is one line, never a hang.
The hostile variants run as forks of one interpreter that imported the CLI (tests/forked_cli.py:
their 10 s are their own, after the imports; their RSS counts the imports); the other runs are
fresh processes.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest
from forked_cli import ForkedCli

from evalrun.engine.config import ConfigError, ModelConfig
from evalrun.engine.tokenizer import Tokenizer, TokenizerError
from evalrun.engine.weights import WeightsError, weight_files

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "mmlu"
DEADLINE_S = 10.0
MAX_RSS_BYTES = 1 << 30
# the line a run prints before it loads the model (the settings it resolved); anything else is an error
SETTINGS_LINE = "evalrun mmlu: device "


# --- building variants ----------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    """A copy of a model directory (hard links: write a file with _put, never in place)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        os.link(f, dst / f.name)
    return dst


def _put(path: Path, data: "str | bytes") -> None:
    if os.path.lexists(path):
        path.unlink()
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def _link(path: Path, target: "str | Path") -> None:
    if os.path.lexists(path):
        path.unlink()
    path.symlink_to(target)


def _config(**changes) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        config.update(changes)
        _put(model / "config.json", json.dumps(config))
    return edit


def _outside_copy(name: str) -> Callable[[Path], None]:
    """`name` becomes a link to a copy of itself outside the model directory."""
    def edit(model: Path) -> None:
        outside = model.parent / f"outside-{model.name}-{name}"
        outside.write_bytes((model / name).read_bytes())
        _link(model / name, outside)
    return edit


def _shard_name(name: str) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        _put(model / "model.safetensors.index.json", json.dumps({"weight_map": {"lm_head.weight": name}}))
    return edit


LLAMA3_EQUAL = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}
OUTPUT_BOMB = "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}"
MEMORY_BOMB = "{{ 'x' * 10**10 }}"
# name -> (how the tiny model is changed, what the one error line says, extra CLI arguments)
VARIANTS: dict[str, tuple[Callable[[Path], None], str, tuple[str, ...]]] = {
    "heads_zero": (_config(num_attention_heads=0),
                   "config field num_attention_heads must be a positive integer, got 0", ()),
    "heads_string": (_config(num_attention_heads="4"),
                     "config field num_attention_heads must be a positive integer, got '4'", ()),
    "heads_bool": (_config(num_attention_heads=True),
                   "config field num_attention_heads must be a positive integer, got True", ()),
    "hidden_list": (_config(hidden_size=[64]),
                    "config field hidden_size must be a positive integer, got [64]", ()),
    "kv_heads_not_dividing": (_config(num_key_value_heads=3),
                              "num_attention_heads (4) is not a multiple of num_key_value_heads (3)",
                              ()),
    "hidden_not_multiple": (_config(hidden_size=66, head_dim=None),
                            "config field hidden_size (66) is not a multiple of num_attention_heads (4)", ()),
    "positions_1e12": (_config(max_position_embeddings=10**12),
                       "config field max_position_embeddings must be at most 16777216, got 1000000000000", ()),
    "layers_1e9": (_config(num_hidden_layers=10**9),
                   "config field num_hidden_layers must be at most 4096, got 1000000000", ()),
    "vocab_negative": (_config(vocab_size=-1), "config field vocab_size must be a positive integer, got -1", ()),
    "eps_negative": (_config(rms_norm_eps=-1e-6),
                     "config field rms_norm_eps must be a positive number, got -1e-06", ()),
    "eps_nan": (lambda m: _put(m / "config.json", (m / "config.json").read_text().replace('"rms_norm_eps": 1e-06',
                                                                                           '"rms_norm_eps": NaN')),
                "config.json is not valid JSON: NaN is not a JSON value", ()),
    "rope_theta_inf": (lambda m: _put(m / "config.json", (m / "config.json").read_text().replace(
                           '"rope_theta": 10000.0', '"rope_theta": 1e999')),                 # json reads inf
                       "config field rope_parameters.rope_theta must be a positive number, got inf", ()),
    "rope_scaling_string": (_config(rope_scaling="linear"),
                            "config field rope_scaling must be an object, got 'linear'", ()),
    "rope_factor_string": (_config(rope_scaling={"rope_type": "linear", "factor": "2"}),
                           "config field rope_scaling.factor must be a positive number, got '2'", ()),
    "llama3_zero_band": (_config(rope_parameters=None, rope_scaling=LLAMA3_EQUAL),
                         "llama3 rope scaling needs low_freq_factor (4.0) below high_freq_factor (4.0)", ()),
    "tie_string": (_config(tie_word_embeddings="false"),
                   "config field tie_word_embeddings must be true or false, got 'false'", ()),
    "architectures_string": (_config(architectures="LlamaForCausalLM"),
                             "config field architectures must be a list of strings", ()),
    "architectures_number": (_config(architectures=[5]), "config field architectures must be a list of strings",
                             ()),
    "gemma_pattern_zero": (_config(architectures=["Gemma3ForCausalLM"], sliding_window_pattern=0),
                           "config field sliding_window_pattern must be a positive integer, got 0", ()),
    "eos_string": (_config(eos_token_id="2"), "config field eos_token_id must be a token id", ()),
    "config_not_json": (lambda m: _put(m / "config.json", b"\x00{garbage"), "config.json is not valid JSON", ()),
    "config_array": (lambda m: _put(m / "config.json", "[1, 2]"),
                     "config.json: must hold a JSON object, not list", ()),
    "config_deep": (lambda m: _put(m / "config.json", "[" * 200_000),
                    "config.json is not valid JSON: maximum recursion depth exceeded", ()),
    "config_too_big": (lambda m: _put(m / "config.json", b" " * (17 << 20) + b"{}"),
                       "config.json: refused: larger than 16777216 bytes", ()),
    "config_link_environ": (lambda m: _link(m / "config.json", "/proc/self/environ"),
                            "config.json: refused: it is a symbolic link (to /proc/self/environ)", ()),
    "tokenizer_link_outside": (_outside_copy("tokenizer.json"), "tokenizer.json: refused: it is a symbolic link", ()),
    "tokenizer_array": (lambda m: _put(m / "tokenizer.json", "[1]"),
                        "tokenizer.json: not a readable Hugging Face tokenizer file", ()),
    "tokenizer_config_not_json": (lambda m: _put(m / "tokenizer_config.json", "{'bos_token': 1"),
                                  "tokenizer_config.json is not valid JSON", ()),
    "tokenizer_config_array": (lambda m: _put(m / "tokenizer_config.json", "[]"),
                               "tokenizer_config.json: must hold a JSON object, not list", ()),
    "generation_config_link_environ": (lambda m: _link(m / "generation_config.json", "/proc/self/environ"),
                                       "generation_config.json: refused: it is a symbolic link", ()),
    "weights_link_outside": (_outside_copy("model.safetensors"), "model.safetensors: refused: it is a symbolic link",
                             ()),
    "index_shard_outside": (_shard_name("../../../etc/passwd"),
                            "refused: '../../../etc/passwd' is not a file name inside the model directory", ()),
    "index_shard_absolute": (_shard_name("/etc/passwd"),
                             "refused: '/etc/passwd' is not a file name inside the model directory", ()),
    "chat_template_link_environ": (lambda m: _link(m / "chat_template.jinja", "/proc/self/environ"),
                                   "chat_template.jinja: refused: it is a symbolic link (to /proc/self/environ)",
                                   ("--apply-chat-template",)),
    "chat_template_output_bomb": (lambda m: _put(m / "chat_template.jinja", OUTPUT_BOMB),
                                  "chat_template.jinja: rendering", ("--apply-chat-template",)),
    "chat_template_memory_bomb": (lambda m: _put(m / "chat_template.jinja", MEMORY_BOMB),
                                  "chat_template.jinja: rendering ran out of its 1 GiB memory bound",
                                  ("--apply-chat-template",)),
}


# --- running the CLI under the acceptance bounds ---------------------------------------------------
# NOTE: a child's ru_maxrss starts from its parent's RSS at fork (exec records the forked copy's
# high-water mark), and pytest grows to GBs over the suite: so the command runs under this small
# launcher, which reports the command's own peak (os.wait4) on its stdout and exits as it did.
MEASURE = """
import os, signal, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(usage.ru_maxrss, flush=True)
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
"""


def run_bounded(args: list[str], deadline: float = DEADLINE_S, preexec=None,
                evalrun: bool = True) -> tuple[int, str, float, int]:
    """(exit status, stderr, seconds, peak RSS in bytes) of `python -m evalrun ARGS` (evalrun=False:
    `python ARGS`); SIGKILLed (its whole session) at the deadline: then the status is -9."""
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as out:
        start = time.monotonic()
        command = [sys.executable, "-c", MEASURE, sys.executable, *(["-m", "evalrun"] if evalrun else []), *args]
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out,
                                stderr=err, start_new_session=True, preexec_fn=preexec)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)      # reaped here, not by Popen
        seconds = time.monotonic() - start
        err.seek(0)
        out.seek(0)
        reported = out.read().decode().split()
        peak = int(reported[-1]) if reported else usage.ru_maxrss       # killed at the deadline: the launcher's
        return proc.returncode, err.read().decode(errors="replace"), seconds, peak * 1024


def _mmlu_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["mmlu", "--no-progress", "--model", str(model), "--data-dir", str(FIXTURE), "--limit", "1",
            "--device", "cpu", "--dtype", "float32", "--cache-mode", "fp32", "--output-dir", str(out), *extra]


def assert_one_line(rc: int, err: str, seconds: float, rss: int, says: str) -> str:
    assert rc == 2 and seconds < DEADLINE_S, (rc, seconds, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(SETTINGS_LINE)]
    assert len(lines) == 1 and lines[0].startswith("evalrun mmlu: error: "), err[-3000:]
    assert says in lines[0], lines[0]
    assert rss <= MAX_RSS_BYTES, f"peak RSS {rss / 2**20:.0f} MiB"
    return lines[0]


@pytest.fixture(scope="module")
def forked_cli():
    """The CLI's imports paid once for the variants below (tests/forked_cli.py: each run a fork)."""
    with ForkedCli(ROOT) as cli:
        yield cli


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_hostile_variant_is_one_line_exit_2(name, tiny_model_dir, tmp_path, forked_cli):
    edit, says, extra = VARIANTS[name]
    model = _copy(tiny_model_dir, tmp_path / "model")
    edit(model)
    assert_one_line(*forked_cli.run(_mmlu_args(model, tmp_path / "run", *extra), DEADLINE_S, ROOT,
                                    tmp_path / "stderr.txt"), says)


def test_a_context_of_2_to_the_24_costs_nothing_until_used(tiny_model_dir, tmp_path):
    """max_position_embeddings at the schema's bound is served; the rope table grows with the
    positions a run reaches (it would take 2 GiB at once for this model's 16-wide heads)."""
    model = _copy(tiny_model_dir, tmp_path / "model")
    _config(max_position_embeddings=1 << 24)(model)
    rc, err, seconds, rss = run_bounded(_mmlu_args(model, tmp_path / "run"), deadline=60)
    assert rc == 0, err[-3000:]
    assert rss <= MAX_RSS_BYTES, f"peak RSS {rss / 2**20:.0f} MiB"


def test_rope_rows_grow_with_the_positions_reached(tiny_model_factory):
    """The rope table starts at ROPE_ROWS rows, doubles as positions beyond it come, and every row is
    bitwise the row of a table made at once."""
    import torch

    from evalrun.engine.model import ROPE_ROWS, Model
    from evalrun.engine.rope import rope_inv_freq, rope_table

    model = Model.load(tiny_model_factory(max_position_embeddings=1 << 20), dtype="float32")
    assert model.rope_tables[0][0].shape == (ROPE_ROWS, model.config.rope_dim)
    grown = model.rope_rows(ROPE_ROWS + 1)
    assert grown[0][0].shape[0] == 2 * ROPE_ROWS
    assert model.rope_rows(10) is grown                                  # no shrinking, no copy
    full = rope_table(rope_inv_freq(model.config.rope, model.config.rope_dim), 5 * ROPE_ROWS)
    assert all(torch.equal(got, want[: 2 * ROPE_ROWS]) for got, want in zip(grown[0], full))
    assert model.rope_rows(1 << 30)[0][0].shape[0] == 1 << 20            # never past max_seq_len


# --- O_NOFOLLOW semantics, in process --------------------------------------------------------------
def _hub_snapshot(root: Path, model: Path, repo: str = "models--org--tiny") -> Path:
    """`model` laid out as a hub cache: snapshots/REV/* are relative links to ../../blobs/<n>."""
    blobs, snapshot = root / repo / "blobs", root / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(model.iterdir())):
        os.link(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(os.path.relpath(blobs / f"blob{i}", snapshot))
    return snapshot


def test_hub_cache_links_into_their_own_blobs_are_read(tiny_model_dir, tmp_path):
    snapshot = _hub_snapshot(tmp_path / "hub", tiny_model_dir)
    assert ModelConfig.load(snapshot) == ModelConfig.load(tiny_model_dir)
    assert set(weight_files(snapshot)) == set(weight_files(tiny_model_dir))
    text = "The hub cache's layout is read as the directory it links to."
    assert Tokenizer.load(snapshot).encode(text) == Tokenizer.load(tiny_model_dir).encode(text)
    rc, err, _, _ = run_bounded(_mmlu_args(snapshot, tmp_path / "run"), deadline=60)
    assert rc == 0, err[-3000:]


def test_links_out_of_the_hub_layout_are_refused(tiny_model_dir, tmp_path):
    """A snapshot's link into another repo's blobs, or a link that is not the hub's (inside a
    plain directory, even to a file of that directory), is refused like any link."""
    snapshot = _hub_snapshot(tmp_path / "hub", tiny_model_dir)
    other = _hub_snapshot(tmp_path / "hub", tiny_model_dir, repo="models--org--other")
    _link(other / "config.json", snapshot.parent.parent / "blobs" / "blob1")
    with pytest.raises(ConfigError, match=r"config\.json: refused: it is a symbolic link"):
        ModelConfig.load(other)
    plain = _copy(tiny_model_dir, tmp_path / "plain")
    os.rename(plain / "tokenizer.json", plain / "real-tokenizer.json")
    _link(plain / "tokenizer.json", "real-tokenizer.json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: refused: it is a symbolic link"):
        Tokenizer.load(plain)


def test_a_linked_folder_and_special_files_are_refused(tiny_model_dir, tmp_path):
    elsewhere = _copy(tiny_model_dir, tmp_path / "elsewhere")
    model = tmp_path / "model"
    model.mkdir()
    (model / "shards").symlink_to(elsewhere)
    os.link(tiny_model_dir / "config.json", model / "config.json")
    _put(model / "model.safetensors.index.json", json.dumps({"weight_map": {"x": "shards/model.safetensors"}}))
    with pytest.raises(WeightsError, match="resolves to .*, outside the model directory"):
        weight_files(model)
    fifo = _copy(tiny_model_dir, tmp_path / "fifo")
    (fifo / "tokenizer_config.json").unlink()
    os.mkfifo(fifo / "tokenizer_config.json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: refused: not a regular file"):
        Tokenizer.load(fifo)                         # an open would block forever


# --- GGUF metadata ----------------------------------------------------------------------------------
GGUF_BASE = {"llama.block_count": 2, "llama.embedding_length": 64, "llama.feed_forward_length": 128,
             "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.context_length": 2048,
             "llama.vocab_size": 49152}


def metadata_gguf(path: Path, **fields) -> Path:
    """A GGUF file of metadata only (no tensors): a llama's, with `fields` (GGUF key -> value) over it."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "llama")
    for key, value in {**GGUF_BASE, **fields}.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint64(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_VARIANTS = {
    "head_count_zero": ({"llama.attention.head_count": 0},
                        "GGUF metadata llama.attention.head_count must be a positive integer, got 0"),
    "head_count_string": ({"llama.attention.head_count": "4"},
                          "GGUF metadata llama.attention.head_count must be a positive integer, got '4'"),
    "context_1e12": ({"llama.context_length": 10**12}, "GGUF metadata llama.context_length must be at most 16777216"),
    "kv_heads_strings": ({"llama.attention.head_count_kv": ["2", "2"]},
                         "GGUF metadata llama.attention.head_count_kv must be a positive integer, got '2'"),
    "eps_negative": ({"llama.attention.layer_norm_rms_epsilon": -1.0},
                     "GGUF metadata llama.attention.layer_norm_rms_epsilon must be a positive number, got -1.0"),
    "rope_base_nan": ({"llama.rope.freq_base": float("nan")},
                      "GGUF metadata llama.rope.freq_base must be a positive number, got nan"),
    "layers_bool": ({"llama.block_count": True},
                    "GGUF metadata llama.block_count must be a positive integer, got True"),
    "eos_string": ({"tokenizer.ggml.eos_token_id": "2"},
                   "GGUF metadata tokenizer.ggml.eos_token_id must be a token id"),
    "rope_factor_string": ({"llama.rope.scaling.factor": "2"},
                           "GGUF metadata llama.rope.scaling.factor must be a positive number, got '2'"),
}


@pytest.mark.parametrize("name", sorted(GGUF_VARIANTS))
def test_gguf_metadata_of_the_wrong_type_names_the_key(name, tmp_path):
    from evalrun.engine.gguf import open_gguf

    fields, says = GGUF_VARIANTS[name]
    path = metadata_gguf(tmp_path / "bad.gguf", **fields)
    with pytest.raises(ConfigError) as info:
        open_gguf(path).model_config()
    assert str(info.value) == f"{path}: {says}" or str(info.value).startswith(f"{path}: {says}"), str(info.value)


def test_gguf_metadata_on_the_cli_is_one_line(tmp_path):
    path = metadata_gguf(tmp_path / "bad.gguf", **{"llama.attention.head_count": "4"})
    assert_one_line(*run_bounded(_mmlu_args(path, tmp_path / "run")),
                    f"{path}: GGUF metadata llama.attention.head_count must be a positive integer, got '4'")


def test_a_gguf_link_out_of_its_folder_is_refused(tmp_path):
    real = metadata_gguf(tmp_path / "real.gguf")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "linked.gguf").symlink_to(real)
    assert_one_line(*run_bounded(_mmlu_args(tmp_path / "models" / "linked.gguf", tmp_path / "run")),
                    "linked.gguf: refused: it is a symbolic link")


# --- memory ------------------------------------------------------------------------------------------
def _address_space(limit: int) -> Callable[[], None]:
    """preexec_fn: RLIMIT_AS for the child (set before exec: a fresh interpreter, not a fork of ours)."""
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return set_limit


def test_a_cache_beyond_the_address_space_limit_is_one_line(tiny_model_dir, tmp_path):
    rc, err, seconds, rss = run_bounded(_mmlu_args(tiny_model_dir, tmp_path / "run", "--cache-memory", "16GiB"),
                                        preexec=_address_space(8 << 30))
    assert_one_line(rc, err, seconds, rss, "this process may still map under its address-space limit (RLIMIT_AS)")


# The CLI with RLIMIT_AS set when Model.load starts: VmSize + 16 MiB, less than this model's weights take
# (a 25 MB mapping and their copies), so the load fails in an allocation (safetensors' mmap or torch's).
LOAD_UNDER_LIMIT = """
import resource, sys
from evalrun.commands.cli import main
from evalrun.engine import Model
load = Model.load.__func__
def limited(cls, *args, **kwargs):
    used = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (used + (16 << 20), resource.RLIM_INFINITY))
    return load(cls, *args, **kwargs)
Model.load = classmethod(limited)
raise SystemExit(main(sys.argv[1:]))
"""


def test_a_model_load_that_runs_out_of_memory_is_one_line(tiny_model_dir, tmp_path):
    """A memory failure while loading ends the run in one line (exit 2), not a traceback or a hang."""
    rc, err, seconds, rss = run_bounded(["-c", LOAD_UNDER_LIMIT, *_mmlu_args(tiny_model_dir, tmp_path / "run")],
                                        evalrun=False)
    assert_one_line(rc, err, seconds, rss, f"not enough memory to load the model {tiny_model_dir} "
                                           "(address-space limit RLIMIT_AS")
