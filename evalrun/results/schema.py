"""Names and record shapes of a run directory (a contract other tools script against).

    <run_dir>/
      manifest.json            atomic JSON; see `Manifest`
      .lock                    flock held by the open RunStore
      samples/
        part-000000-1a2b3c4d.parquet   one file per flush (complete or absent)
        .part-...parquet.tmp           in-flight write, removed on the next open
        _quarantine-part-...parquet    torn or damaged part moved aside (ignored by pyarrow.dataset)
        _checksums.jsonl               {"part", "sha256"} of each part, written before it is published
      prompts/
        part-000000-1a2b3c4d.parquet   prompt_hash, prompt: each distinct prompt once (evalrun/results/prompts.py)
      samples.parquet          all parts merged, deduplicated on the key, sorted by key (its sha256:
                               manifest["samples_sha256"]; see evalrun/results/checksums.py)
      summary.parquet          per-subject (or per-group) rows from write_summary
      summary.json             headline numbers from write_summary
"""

from __future__ import annotations

import re
from typing import Any, Optional, TypedDict

SCHEMA_VERSION = 2     # 2: MMLU identity without the selection, prompt_format, prompts/ table

MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".lock"
SAMPLES_DIR = "samples"
SAMPLES_FILE = "samples.parquet"
PROMPTS_DIR = "prompts"
SUMMARY_PARQUET = "summary.parquet"
SUMMARY_JSON = "summary.json"
QUARANTINE_PREFIX = "_quarantine-"
TMP_SUFFIX = ".tmp"
CHECKSUMS_FILE = "_checksums.jsonl"     # in samples/

# Parquet key-value metadata of samples.parquet: JSON list of the part names merged into it.
MERGED_PARTS_METADATA_KEY = b"evalrun.merged_parts"

PART_RE = re.compile(r"^part-(\d{6,})-([0-9a-f]{8})\.parquet$")


def part_name(seq: int, uuid8: str) -> str:
    return f"part-{seq:06d}-{uuid8}.parquet"


class ModelFingerprint(TypedDict):
    """Returned by `fingerprint_model_dir`. Hashes are sha256 hex digests (None: file absent)."""

    path: str
    files: dict[str, Optional[str]]  # config.json, tokenizer.json, tokenizer_config.json, ...
    weights_index: Optional[dict[str, str]]  # {"name", "sha256"} of *.index.json, if any
    weights: list[dict[str, Any]]  # [{"name", "size", "sample_sha256"}] per weight file
    model_fingerprint: str  # config + weights index + weight samples
    tokenizer_fingerprint: str  # tokenizer files only


class Throughput(TypedDict):
    """Returned by `throughput`; stored under manifest["throughput"]."""

    prompt_tokens: int  # all prompt tokens of all requests
    prefill_tokens_computed: int  # prompt tokens actually run through the model
    generated_tokens: int
    dedup_ratio: Optional[float]  # prompt / computed: 4.0 means 3 of 4 prompt tokens came from cache
    wall_seconds: float
    tokens_per_s: Optional[float]  # (prompt + generated) / wall
    prefill_tokens_per_s: Optional[float]  # prefill_tokens_computed / wall


class Resume(TypedDict, total=False):
    """One entry of manifest["resumes"]: a later session of the same run."""

    at: str  # when it opened the run (TIME_FORMAT)
    cli_args: list[str]
    end_time: str  # this session's figures, when it finished (the first run's stay at the top level)
    throughput: Throughput
    wall_seconds: float  # humaneval --score-samples
    ray: dict[str, Any]  # --ray: this session's replicas, retries and failed parcels (see Manifest.ray)
    sandbox: dict[str, Any]  # humaneval --ray --execute-on replica: the replicas' isolation


class Manifest(TypedDict, total=False):
    """manifest.json. The caller supplies the first block; RunStore fills the store-owned ones.
    Every timestamp is UTC in results.manifest.TIME_FORMAT, e.g. "2026-11-30T17:51:09Z"."""

    # supplied by the caller (evalrun's commands)
    task: str  # "mmlu", "humaneval", "humaneval-score"
    identity: dict[str, Any]  # compared on resume: task, fingerprints, resolved engine settings, format
    model: dict[str, Any]  # `fingerprint_model_dir(path)` plus the resolved path; a .gguf file adds "gguf": {"file", "architecture", "file_type" (e.g. "Q4_K_M"), "tensor_types" ({type: count}), "sha256" (whole file), "bytes"}
    dtype: str  # resolved: "float32", "bfloat16", "float16" (never "auto")
    device: str  # resolved: "cpu", "cuda", "cuda:N"
    cache_mode: str  # resolved: "fp32", "bf16", "fp16", "q8", "q6", "q4"
    engine_choices: dict[str, dict[str, Any]]  # per setting: {"requested", "value", "reason"}; an auto dtype measured by the dtype probe adds "probe": {"ratio", "margin", "float32_total_s", "bfloat16_total_s", "seconds": [{"linear", "shape", "rows", "float32", "bfloat16"}], "backends", "measured", "cached", "cache_file"}
    page_size: int
    cache_tokens: int  # tokens the cache holds (from --cache-tokens, or what --cache-memory fits)
    cache_bytes_per_token: int  # KV storage per token over all layers, scales included
    cache_memory_bytes: int  # the cache's allocation, null page and window store included
    cache_window: int  # q8/q6/q4: tokens of the current block attended exactly (0: none)
    cache_window_jobs: int  # running jobs the window store holds (0 without a window)
    cache_window_bytes_per_job: int  # the window store of one job over all layers (fp16 K and V)
    cache_format: str  # e.g. "q4: 4-bit K, 4-bit V, one fp16 scale per 32 values, 32-point Hadamard rotation"
    # the kernel plan that ran: backend, linear, lm_head, kv_write, rope_write, decode_attention,
    # prefill_attention, norm_act, head_norm, gate_up_silu, decode_step, cuda_graphs, stream (the
    # residual stream's dtype between the ops)
    kernels: dict[str, str]
    deterministic: bool  # batch-invariant linears (--deterministic): a row's results do not depend on its batch
    cuda_graphs: bool  # decode steps replayed as CUDA graphs (CUDA without --eager)
    speculative: dict[str, Any]  # {"drafts": None | "ngram" | "model", "num_draft_tokens", "draft_model": path}
    sandbox: dict[str, Any]  # humaneval: the isolation level in force and what it does not isolate
    n_samples: int  # humaneval: of the session that started the run
    limit: Optional[int]  # humaneval: of the session that started the run
    samples_file: str  # humaneval --score-samples
    shard: dict[str, Any]  # --shard K/N: {"index", "count", "units", "docs", "selection": {"sha256", "docs", ...}, "keys": its rows' keys}
    merged_from: list[dict[str, Any]]  # evalrun merge: [{"path", "run_id", "shard", "throughput"}] per shard
    # --ray (of the session that started the run; a resume's in its `resumes` entry): the options, "parcels",
    # "rows", "duplicates_dropped", "actors" [{"slot", "instance", "pid", "node", "parcels", "rows", "end"}],
    # "retries" [{"parcel", "units", "slot", "attempt", "error", "rows_kept", "docs_left", "outcome"}], "failed"
    ray: dict[str, Any]
    seeds: dict[str, int]
    cli_args: list[str]
    # set by RunStore.open (setdefault: a caller value wins)
    schema_version: int
    run_id: str
    key_columns: list[str]
    start_time: str
    environment: dict[str, Any]  # `environment_info()`: python, platform, packages, git sha
    status: str  # "running" | "finalized"
    resumes: list[Resume]  # one per later session
    # set at the end (finalize / RunStore.record_session of the session that started the run)
    finalized_at: str
    num_samples: int
    samples_sha256: str  # sha256 of samples.parquet as written (evalrun/results/checksums.py)
    end_time: str
    throughput: Throughput
    wall_seconds: float  # humaneval --score-samples
