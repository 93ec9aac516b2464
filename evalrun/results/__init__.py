"""Run-directory result store: manifest.json, crash-safe sample parts, samples.parquet, summary.

Depends on pandas/pyarrow only (never on evalrun.engine, evalrun.tasks or the CLI modules of evalrun/).
"""

from evalrun.results.errors import NotARunDirError, ResumeMismatchError, RunDirBusyError
from evalrun.results.manifest import environment_info, fingerprint_model_dir, read_manifest, throughput
from evalrun.results.schema import SCHEMA_VERSION, Manifest, ModelFingerprint, Throughput
from evalrun.results.prompts import read_prompt_messages, read_prompts, write_prompts
from evalrun.results.samples_read import read_samples, samples_file_intact, stored_keys
from evalrun.results.store import RunStore, check_resumable, inspect_run
from evalrun.results.summary import write_summary

__all__ = [
    "SCHEMA_VERSION",
    "check_resumable",
    "inspect_run",
    "Manifest",
    "ModelFingerprint",
    "NotARunDirError",
    "ResumeMismatchError",
    "RunDirBusyError",
    "RunStore",
    "Throughput",
    "environment_info",
    "fingerprint_model_dir",
    "read_manifest",
    "read_prompt_messages",
    "read_prompts",
    "read_samples",
    "samples_file_intact",
    "stored_keys",
    "write_prompts",
    "throughput",
    "write_summary",
]
