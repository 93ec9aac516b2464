"""Execute a prepared run here, or (--ray) on Ray replicas; either way into the same run directory
(evalrun/run/pipeline.py draws the flow)."""
from __future__ import annotations

from typing import Optional

from evalrun.run.engine_config import announce
from evalrun.run.pipeline import ModelLoader, PreparedRun, generate, report_stored, score_without_model
from evalrun.scale.ray_run import ray_generate


def execute(prepared: PreparedRun, loader: Optional[ModelLoader] = None) -> int:
    """Compute what the run has left and report; nothing left: report the stored rows."""
    p = prepared
    if p.todo.nothing_left:
        return report_stored(p.run, p.todo, p.report)
    if p.cfg is None or p.model_dir is None:
        with p.context():
            return score_without_model(p.run, p.todo, p.report)
    announce(p.command, p.cfg)
    with p.context():
        if p.ray is not None:
            return ray_generate(p)
        return generate(p.run, p.todo, p.cfg, p.model_dir, p.report, loader or ModelLoader())
