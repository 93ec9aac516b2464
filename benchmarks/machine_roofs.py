"""This machine's measured float32 roofs, so a benchmark's figures can be judged on any CPU (issue 12, item 4).

- arithmetic roof: a large float32 sgemm (`torch.mm`, 2048 x 2048 x 2048 by default), best of 5,
  on all torch threads, in GFLOP/s (2 n^3 flops per product);
- memory-bandwidth roof: `torch.sum` over a 256 MiB float32 tensor (bytes read), best of 5, and a
  `copy_` of one 256 MiB tensor into another (bytes read + bytes written), in GB/s (1e9 bytes).

Also the decode floors these roofs imply for a model: the linears' flops per token and the
weight bytes every decode step must read (see `model_work`, `step_floor_s`).

    python -m benchmarks.machine_roofs [--n 2048] [--mib 256] [--repeat 5] [--out FILE]

Other processes on the machine lower the roofs as much as the figures beside them: the
benchmarks measure them in the same run (bench_decode: at its start and at its end).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypedDict

import torch


class Roofs(TypedDict):
    sgemm_gflops: float          # best of `repeat`, 2 n^3 / s / 1e9
    sgemm_n: int
    read_gbps: float             # torch.sum over `mib` MiB, bytes read / s / 1e9
    copy_gbps: float             # copy_ of `mib` MiB, (bytes read + written) / s / 1e9
    buffer_mib: int
    repeat: int
    threads: int                 # torch.get_num_threads() while measuring


def _best_seconds(fn: Callable[[], Any], repeat: int) -> float:
    fn()                                                      # warm-up: first-touch pages, thread pool
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def sgemm_gflops(n: int = 2048, repeat: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """torch's n^3 matmul rate in `dtype` (float32: the sgemm roof; bfloat16: the bf16 matmul roof)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n ** 3 / _best_seconds(lambda: torch.mm(a, b, out=out), repeat) / 1e9


def bandwidth_gbps(mib: int = 256, repeat: int = 5) -> tuple[float, float]:
    """(read GB/s of a sum, read+write GB/s of a copy) over float32 buffers of `mib` MiB."""
    nbytes = mib << 20
    src = torch.ones(nbytes // 4)
    read = nbytes / _best_seconds(lambda: src.sum(), repeat) / 1e9
    dst = torch.empty_like(src)
    copy = 2 * nbytes / _best_seconds(lambda: dst.copy_(src), repeat) / 1e9
    return read, copy


def measure_roofs(n: int = 2048, mib: int = 256, repeat: int = 5) -> Roofs:
    with torch.inference_mode():
        flops = sgemm_gflops(n, repeat)
        read, copy = bandwidth_gbps(mib, repeat)
    return Roofs(sgemm_gflops=flops, sgemm_n=n, read_gbps=read, copy_gbps=copy, buffer_mib=mib,
                 repeat=repeat, threads=torch.get_num_threads())


def best_roofs(*measured: Roofs) -> Roofs:
    """The highest of each roof over several measurements: a roof is what the machine can do,
    and a busy moment only lowers it."""
    best = dict(measured[0])
    for key in ("sgemm_gflops", "read_gbps", "copy_gbps"):
        best[key] = max(r[key] for r in measured)
    return Roofs(**best)  # type: ignore[typeddict-item]


def format_roofs(r: Roofs) -> str:
    return (f"sgemm {r['sgemm_gflops']:.0f} GFLOP/s, read {r['read_gbps']:.1f} GB/s, "
            f"copy {r['copy_gbps']:.1f} GB/s ({r['threads']} threads)")


# --- floors for a decoder model -------------------------------------------------------
class ModelWork(TypedDict):
    body_flops_per_token: float  # the layers' linears, 2 * params (attention scores/values not counted)
    head_flops_per_token: float  # the LM head, needed at sampled positions only
    weight_bytes: float          # linears + LM head in the compute dtype: read once per decode step


def model_work(model_dir: Path, dtype_bytes: int = 4) -> ModelWork:
    """Flops and weight bytes of a Llama-style model, from its config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, i, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    body = layers * (h * (q + 2 * kv) + q * h + 3 * h * i)   # qkv, o, gate + up + down
    head = vocab * h
    return ModelWork(body_flops_per_token=2.0 * body, head_flops_per_token=2.0 * head,
                     weight_bytes=float(dtype_bytes * (body + head)))


def step_floor_s(work: ModelWork, rows: int, roofs: Roofs) -> float:
    """Least time of one decode step of `rows` rows: the linears at the sgemm roof, or every weight
    read once at the read roof, whichever is longer (attention and the KV reads not counted)."""
    flops = rows * (work["body_flops_per_token"] + work["head_flops_per_token"])
    return max(flops / (roofs["sgemm_gflops"] * 1e9), work["weight_bytes"] / (roofs["read_gbps"] * 1e9))


def run_floor_s(work: ModelWork, prompt_tokens: int, rows: int, new_tokens: int, roofs: Roofs) -> float:
    """Least time of a batched run: the prompts' linears at the sgemm roof (LM head once per row),
    then `new_tokens - 1` decode steps of `rows` rows at `step_floor_s`."""
    prefill = (prompt_tokens * work["body_flops_per_token"] + rows * work["head_flops_per_token"])
    return prefill / (roofs["sgemm_gflops"] * 1e9) + (new_tokens - 1) * step_floor_s(work, rows, roofs)


def attention_floor_s(model_dir: Path, prompt_lens: Sequence[int], new_tokens: int, kv_bytes: int,
                      roofs: Roofs) -> float:
    """Least time of a batched generation's attention: the prompts' causal scores and value sums
    (4 D flops per query head and key it sees) at the sgemm roof, and every decode step's read of
    each row's keys and values (`kv_bytes` per element) at the read roof."""
    cfg = json.loads((model_dir / "config.json").read_text())
    layers, hq, hkv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    flops = layers * sum(4 * d * hq * n * (n + 1) / 2 for n in prompt_lens)
    steps = new_tokens - 1                   # the first new token comes from the prefill
    positions = sum(steps * n + steps * (steps + 1) / 2 for n in prompt_lens)
    reads = layers * 2 * hkv * d * kv_bytes * positions
    return flops / (roofs["sgemm_gflops"] * 1e9) + reads / (roofs["read_gbps"] * 1e9)


def measure_roofs_in(dtype: torch.dtype) -> Roofs:
    """measure_roofs, the matmul roof in `dtype` (bfloat16: torch's bf16 matmul rate)."""
    roofs = measure_roofs()
    if dtype != torch.float32:
        roofs["sgemm_gflops"] = sgemm_gflops(roofs["sgemm_n"], roofs["repeat"], dtype)
    return roofs


def main(argv: Optional[Sequence[str]] = None) -> Roofs:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.machine_roofs", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="sgemm size (default 2048)")
    parser.add_argument("--mib", type=int, default=256, help="bandwidth buffer MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="best of this many (default 5)")
    parser.add_argument("--out", type=Path, default=None, help="also write the roofs and the machine as JSON")
    args = parser.parse_args(argv)
    roofs = measure_roofs(args.n, args.mib, args.repeat)
    print(f"roofs: {format_roofs(roofs)}")
    if args.out is not None:
        from benchmarks.common import machine_info, write_result
        write_result(args.out, {"benchmark": "machine_roofs", "machine": machine_info(), "roofs": roofs})
    return roofs


if __name__ == "__main__":
    main()
