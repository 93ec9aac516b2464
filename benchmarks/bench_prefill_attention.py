"""Prefill attention alone: the native paged kernel (evalrun/kernels/cpu/csrc/paged_prefill.c) against the torch
reference it replaces (each sequence's context gathered from the pages, then SDPA), at prefill
shapes of SmolLM2 (9 query heads on 3 KV heads of 64, pages of 256), float32 and bfloat16 pages,
per layer call.

    python -m benchmarks.bench_prefill_attention [--rounds 7] [--repeat 5] [--kv fp32,bf16] [--threads N]
        [--baseline-source OLD.c] [--no-sdpa] [--shapes mmlu,...] [--out FILE]

Shapes: "mmlu" (20 questions after a cached 5-shot prefix: contexts 470-603, 64-96 new tokens),
"mmlu700" (20 questions of 72-88 new tokens on contexts of 700-756), "fresh" (two 600-token
prompts from scratch), "humaneval" (32 prompts of 130 tokens from scratch). --baseline-source adds
a side running another version of paged_prefill.c (e.g. `git show REV:evalrun/kernels/cpu/csrc/paged_prefill.c
> /tmp/old.c`), built with the same flags and called with the same arguments, for an A/B in one
process; its outputs are compared bitwise with the current kernel's. Its `#include "..."` headers
resolve next to it first, then in the tree's csrc/: an old copy needs the old headers it changed
(e.g. paged_prefill_tiles.h) beside it, or it is built with the tree's. The sides alternate for
--rounds rounds of --repeat calls; figures are medians, GFLOP/s count the causal work only (4 * D
multiply-adds per query head and key it sees). The large-sgemm roof is measured before and after.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks import kernel_builds
from benchmarks.common import DEFAULT_OUT_DIR, machine_info, positive_int, print_machine, write_result
from benchmarks.machine_roofs import format_roofs, measure_roofs
from evalrun.kernels.cpu import paged_prefill
from evalrun.kernels.attention import build_metadata
from evalrun.kernels.ref.attention import attend
from evalrun.kernels.ref.cache_ops import write_kv_torch
from evalrun.kernels.kv_format import LayerKV, kv_format

NAME = "bench_prefill_attention"
HQ, HKV, D, PAGE = 9, 3, 64, 256
SHAPES = {
    "mmlu": ([470 + 7 * i for i in range(20)], [64 + (i % 5) * 8 for i in range(20)]),
    "mmlu700": ([700 + 7 * (i % 9) for i in range(20)], [72 + (i % 5) * 4 for i in range(20)]),
    "fresh": ([600, 580], [600, 580]),
    "humaneval": ([130] * 32, [130] * 32),
}


def parse_args(argv: Optional[Sequence[str]]) -> Any:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=7, help="alternated rounds (default 7)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="calls per round (default 5)")
    parser.add_argument("--kv", default="fp32,bf16", help="page formats, comma-separated (default fp32,bf16)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated of {', '.join(SHAPES)}")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads, which the kernel's thread count follows (default: as torch has)")
    parser.add_argument("--baseline-source", type=Path, default=None,
                        help="another paged_prefill.c to time against the current one")
    parser.add_argument("--no-sdpa", action="store_true", help="leave out the torch reference side")
    parser.add_argument("--sliding-window", type=int, default=0,
                        help="a layer's sliding window on every side (0: none; Gemma 3's is 512)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / f"{NAME}.json",
                        help=f"JSON result file (default: bench_out/{NAME}.json)")
    return parser.parse_args(argv)


def case(lens: list[int], q_lens: list[int], seed: int = 0, kv: str = "fp32") -> tuple[torch.Tensor, LayerKV, Any]:
    """Random K/V of every context on consecutive pages of one layer of format `kv`, random queries."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in lens]
    layer = LayerKV.allocate(kv_format(kv), sum(pages) + 1, PAGE, HKV, D, torch.device("cpu"))
    tables, first = [], 0
    for n, p in zip(lens, pages):
        table = list(range(first, first + p))
        slots = torch.tensor([table[i // PAGE] * PAGE + i % PAGE for i in range(n)])
        write_kv_torch(torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g), layer, slots)
        tables.append(table)
        first += p
    meta = build_metadata(q_lens, lens, tables, PAGE, sum(pages), torch.device("cpu"))
    return torch.randn(sum(q_lens), HQ, D, generator=g), layer, meta


def build_baseline(source: Path, out_dir: Path) -> ctypes.CDLL:
    """source built as native.py builds the current paged_prefill.c (its flags, the current csrc/ headers),
    loaded after the shared thread pool."""
    return kernel_builds.build(source, out_dir, "baseline", paged_prefill.SIGNATURES)


def alternate(sides: dict[str, Any], rounds: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each side, the sides alternating (reversed every other round)."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else list(sides)[::-1]):
            sides[side]()
            t = time.perf_counter()
            for _ in range(repeat):
                sides[side]()
            times[side].append((time.perf_counter() - t) / repeat)
    return {k: statistics.median(v) for k, v in times.items()}


def causal_flops(lens: list[int], q_lens: list[int]) -> float:
    return sum(4 * D * HQ * q * (n - q + (q + 1) / 2) for n, q in zip(lens, q_lens))


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_info()
    print_machine(info)
    if not paged_prefill.available():
        raise SystemExit("the native prefill kernel is not available here (no compiler, EVALRUN_NATIVE=0, or no AVX2/FMA)")
    tmp = tempfile.TemporaryDirectory()
    baseline = build_baseline(args.baseline_source, Path(tmp.name)) if args.baseline_source else None
    roofs = [measure_roofs()]
    print(f"roofs at start: {format_roofs(roofs[0])}")
    result: dict[str, Any] = {"benchmark": NAME, "machine": info, "config": vars(args) | {
        "out": str(args.out), "baseline_source": str(args.baseline_source or ""),
        "threads": torch.get_num_threads()}, "shapes": {}}
    for kv in args.kv.split(","):
        for name in args.shapes.split(","):
            result["shapes"][f"{name}/{kv}"] = run_shape(name, kv, baseline, args)
    roofs.append(measure_roofs())
    print(f"roofs at end:   {format_roofs(roofs[1])}")
    result["roofs"] = {"start": roofs[0], "end": roofs[1]}
    write_result(args.out, result)
    tmp.cleanup()
    return result


def run_shape(name: str, kv: str, baseline: Optional[ctypes.CDLL], args: Any) -> dict[str, Any]:
    lens, q_lens = SHAPES[name]
    q, layer, meta = case(lens, q_lens, kv=kv)
    scale = D ** -0.5
    seqs = paged_prefill.Sequences.of(meta.page_table, meta.seq_lens_k, meta.cu_seqlens_q.diff())
    w = args.sliding_window
    sides = {"native": lambda: paged_prefill._call(q, layer, seqs, scale, sliding_window=w)}
    if baseline is not None:
        sides["baseline"] = lambda: paged_prefill._call(q, layer, seqs, scale, lib=baseline, sliding_window=w)
    if not args.no_sdpa:
        sides["sdpa"] = lambda: attend(q, layer, meta, scale, sliding_window=w)
    med = alternate(sides, args.rounds, args.repeat)
    flops = causal_flops(lens, q_lens)
    out = sides["native"]()
    s: dict[str, Any] = {"sequences": len(lens), "query_tokens": sum(q_lens), "context_tokens": sum(lens),
                         **{f"{k}_ms": 1e3 * v for k, v in med.items()},
                         **{f"{k}_gflops": flops / v / 1e9 for k, v in med.items()}}
    line = f"{name + '/' + kv:16s} native {s['native_ms']:7.2f} ms ({s['native_gflops']:5.1f} GFLOP/s)"
    for other in ("baseline", "sdpa"):
        if other in sides:
            s[f"{other}_over_native"] = med[other] / med["native"]
            line += f"   {other} {s[other + '_ms']:7.2f} ms ({s[other + '_over_native']:.2f}x)"
    if baseline is not None:
        s["baseline_bitwise_equal"] = bool(torch.equal(sides["baseline"](), out))
        line += f"   bitwise {s['baseline_bitwise_equal']}"
    if "sdpa" in sides:
        s["max_abs_diff"] = (out - sides["sdpa"]()).abs().max().item()
        line += f"   max |diff| {s['max_abs_diff']:.1e}"
    print(line, flush=True)
    return s


if __name__ == "__main__":
    main()
