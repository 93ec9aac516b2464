"""Cache-mode sweeps: `evalrun mmlu ... --cache-mode fp32,q8,q6,q4`.

    prepare every mode's run (OUTPUT_DIR/<mode>/; all checked before anything loads)
      ──► execute them in order with one ModelLoader (the model loads once)
      ──► compare the modes with the first (exact paired statistics) and print the table

Each mode's directory is an ordinary run: resumable, comparable, `evalrun show`-able.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Callable, Sequence

from evalrun.run.common import model_name
from evalrun.run.pipeline import ModelLoader, PreparedRun, execute
from evalrun.scale.shard import shard_suffix

Prepare = Callable[[argparse.Namespace, Sequence[str]], PreparedRun]


def sweep_dirs(root: Path, modes: Sequence[str]) -> list[Path]:
    """The run directory of each mode: OUTPUT_DIR/<cache-mode>/ (a contract)."""
    return [root / mode for mode in modes]


def one_mode(args: argparse.Namespace, mode: str, run_dir: Path, tag: str) -> argparse.Namespace:
    """One run's arguments out of a sweep's or suite's: its mode and directory; --cache-window only
    where the mode has a window (quantized modes); an --export-samples file of its own (`tag`)."""
    from evalrun.engine.cache import CACHE_MODES
    one = copy.copy(args)
    one.cache_mode, one.cache_modes, one.output_dir = mode, [mode], str(run_dir)
    if mode in CACHE_MODES and not CACHE_MODES[mode].quantized:
        one.cache_window = None
    if getattr(args, "export_samples", None):
        one.export_samples = per_run_path(args.export_samples, tag)
    return one


def per_run_path(path: str, tag: str) -> str:
    """samples.jsonl -> samples.q4.jsonl: each run of a sweep or suite exports its own file."""
    p = Path(path)
    base, dot, rest = p.name.partition(".")
    return str(p.with_name(f"{base}.{tag}{dot}{rest}" if dot else f"{base}.{tag}"))


def run_sweep(args: argparse.Namespace, argv: Sequence[str], command: str, prepare: Prepare) -> int:
    modes = list(args.cache_modes)
    root = Path(args.output_dir or f"runs/{command}-{model_name(args.model)}-sweep{shard_suffix(args.shard)}")
    dirs = sweep_dirs(root, modes)
    prepared = []
    for mode, run_dir in zip(modes, dirs):
        prepared.append(prepare(one_mode(args, mode, run_dir, mode), argv))
    loader = ModelLoader()
    for i, (mode, p) in enumerate(zip(modes, prepared)):
        print(f"\n=== sweep {i + 1}/{len(modes)}: cache mode {mode} -> {p.run.out_dir}", file=sys.stderr, flush=True)
        p.run.progress_desc = f"[{i + 1}/{len(modes)} {mode}]"
        status = execute(p, loader)
        if status:
            return status
    print(f"\n=== {command} cache-mode sweep: {', '.join(modes)} against {modes[0]}")
    from evalrun.commands.compare import compare_dirs
    comparison = compare_dirs([str(d) for d in dirs], labels=modes, selection=prepared[0].todo.keys)
    from evalrun.results.compare_format import render_table
    print(render_table(comparison), end="")
    return 0
