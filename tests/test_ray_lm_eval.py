"""`evalrun task --ray`: lm-eval tasks whose `!function` hooks live in --include-path files (lm-eval registers
them under their path, which a replica cannot import) and code tasks (their code_eval checks: in the sandbox
on the replica) give the single-process run's rows on two replicas. Ray runs in a private network namespace
(`unshare -n`, loopback up: shared/FIELD_NOTES.md), the CLI as a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'evalrun[ray]')")
pytest.importorskip("sacrebleu", reason="lm-eval's TaskManager imports sacrebleu: install evalrun[lm-eval]")

from evalrun.commands.cli import main  # noqa: E402
from evalrun.tasks.humaneval_data import load_humaneval  # noqa: E402
from lm_eval_fixtures import write_code_tasks, write_fixture_tasks  # noqa: E402
from tests.run_helpers import IN_NETNS, assert_same_rows, private_netns_works  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.skipif(not private_netns_works(), reason="needs `unshare -n` and `ip` (root): every Ray "
                                "test runs in a private network namespace (shared/FIELD_NOTES.md)")


def test_hooked_and_code_tasks_on_two_replicas_equal_one_process(tiny_model_dir, tmp_path):
    fixtures = write_fixture_tasks(tmp_path / "fixtures", None)
    write_code_tasks(fixtures / "code", load_humaneval().problems[:3])
    args = ["task", "--tasks", "hellaswag_tiny,humaneval_canonical,mbpp_reference", "--include-path", str(fixtures),
            "--model", str(tiny_model_dir), "--dtype", "float32", "--num-fewshot", "1", "--no-progress",
            "--confirm-run-unsafe-code", "--gen-kwargs", "max_gen_toks=8"]
    single, ray_out = tmp_path / "single", tmp_path / "ray"
    assert main([*args, "--output-dir", str(single)]) == 0
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "RAY_USAGE_STATS_ENABLED": "0", "USE_HUB_KERNELS": "0"}
    done = subprocess.run([*IN_NETNS, sys.executable, "-m", "evalrun", *args, "--output-dir", str(ray_out), "--ray",
                           "--replicas", "2", "--ray-timeout", "120"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = assert_same_rows(ray_out, single, ["task_name", "doc_id"])
    metrics = {(r.task_name, r.doc_id): json.loads(r.metrics) for r in rows.itertuples()}
    assert sum(t == "hellaswag_tiny" for t, _ in metrics) >= 3
    assert [m for (t, _), m in sorted(metrics.items()) if t != "hellaswag_tiny"] == \
        [{"pass@1,create_test": 1.0}] * 3 + [{"pass_at_1,reference": 1.0}] * 3
