"""Cache-mode sweeps: `evalrun mmlu ... --cache-mode fp32,q8,q6,q4`.

    prepare every mode's run (OUTPUT_DIR/<mode>/; all checked before anything loads)
      ──► execute them in order with one ModelLoader (the model loads once)
      ──► compare the modes with the first (exact paired statistics) and print the table

Each mode's directory is an ordinary run: resumable, comparable, `evalrun show`-able. Each mode's
RunConfig is the sweep's with dataclasses.replace (evalrun/commands/task.py one_run).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from evalrun.commands.compare import compare_dirs
from evalrun.commands.task import one_run, prepare
from evalrun.results.compare_format import render_table
from evalrun.run.common import model_name
from evalrun.run.config import RunConfig
from evalrun.run.pipeline import ModelLoader
from evalrun.scale.execute import execute
from evalrun.scale.shard import shard_suffix


def sweep_dirs(root: Path, modes: Sequence[str]) -> list[Path]:
    """The run directory of each mode: OUTPUT_DIR/<cache-mode>/ (a contract)."""
    return [root / mode for mode in modes]


def run_sweep(cfg: RunConfig) -> int:
    modes = list(cfg.cache_modes)
    root = Path(cfg.output_dir or f"runs/{cfg.task}-{model_name(cfg.model)}-sweep{shard_suffix(cfg.shard)}")
    dirs = sweep_dirs(root, modes)
    prepared = [prepare(one_run(cfg, mode, run_dir, mode)) for mode, run_dir in zip(modes, dirs)]
    loader = ModelLoader()
    for i, (mode, p) in enumerate(zip(modes, prepared)):
        print(f"\n=== sweep {i + 1}/{len(modes)}: cache mode {mode} -> {p.run.out_dir}", file=sys.stderr, flush=True)
        p.run.progress_desc = f"[{i + 1}/{len(modes)} {mode}]"
        status = execute(p, loader)
        if status:
            return status
    print(f"\n=== {cfg.task} cache-mode sweep: {', '.join(modes)} against {modes[0]}")
    comparison = compare_dirs([str(d) for d in dirs], labels=modes, selection=prepared[0].todo.keys)
    print(render_table(comparison), end="")
    return 0
