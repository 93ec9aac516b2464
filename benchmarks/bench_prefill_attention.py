"""Prefill attention alone: the native paged kernel (evalrun/kernels/cpu/csrc/paged_prefill.c) against the torch
reference it replaces (each sequence's context gathered from the pages, then SDPA), at prefill
shapes of SmolLM2 (9 query heads on 3 KV heads of 64, pages of 256, float32 pages), per layer call.

    python -m benchmarks.bench_prefill_attention [--rounds 7] [--repeat 5] [--out FILE]

Shapes: "mmlu" (20 questions after a cached 5-shot prefix: contexts 470-603, 64-96 new tokens),
"fresh" (two 600-token prompts from scratch), "humaneval" (32 prompts of 130 tokens from scratch).
The two sides alternate for --rounds rounds of --repeat calls; figures are medians, GFLOP/s count the
causal work only (4 * D multiply-adds per query head and key it sees). The large-sgemm roof is
measured before and after, and the two sides' outputs are compared.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

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
    "fresh": ([600, 580], [600, 580]),
    "humaneval": ([130] * 32, [130] * 32),
}


def parse_args(argv: Optional[Sequence[str]]) -> Any:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=7, help="alternated rounds (default 7)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="calls per round (default 5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / f"{NAME}.json",
                        help=f"JSON result file (default: bench_out/{NAME}.json)")
    return parser.parse_args(argv)


def case(lens: list[int], q_lens: list[int], seed: int = 0) -> tuple[torch.Tensor, LayerKV, Any]:
    """Random K/V of every context on consecutive pages of one float32 layer, random queries."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in lens]
    layer = LayerKV.allocate(kv_format("fp32"), sum(pages) + 1, PAGE, HKV, D, torch.device("cpu"))
    tables, first = [], 0
    for n, p in zip(lens, pages):
        table = list(range(first, first + p))
        slots = torch.tensor([table[i // PAGE] * PAGE + i % PAGE for i in range(n)])
        write_kv_torch(torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g), layer, slots)
        tables.append(table)
        first += p
    meta = build_metadata(q_lens, lens, tables, PAGE, sum(pages), torch.device("cpu"))
    return torch.randn(sum(q_lens), HQ, D, generator=g), layer, meta


def causal_flops(lens: list[int], q_lens: list[int]) -> float:
    return sum(4 * D * HQ * q * (n - q + (q + 1) / 2) for n, q in zip(lens, q_lens))


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    info = machine_info()
    print_machine(info)
    if not paged_prefill.available():
        raise SystemExit("the native prefill kernel is not available here (no compiler, EVALRUN_NATIVE=0, or no AVX2/FMA)")
    roofs = [measure_roofs()]
    print(f"roofs at start: {format_roofs(roofs[0])}")
    result: dict[str, Any] = {"benchmark": NAME, "machine": info, "config": vars(args) | {"out": str(args.out)},
                              "shapes": {}}
    scale = D ** -0.5
    for name, (lens, q_lens) in SHAPES.items():
        q, layer, meta = case(lens, q_lens)
        sides = {"native": lambda: attend(q, layer, meta, scale, prefill=paged_prefill.prefill_native),
                 "sdpa": lambda: attend(q, layer, meta, scale)}
        times: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else list(sides)[::-1]):
                sides[side]()
                t = time.perf_counter()
                for _ in range(args.repeat):
                    sides[side]()
                times[side].append((time.perf_counter() - t) / args.repeat)
        flops = causal_flops(lens, q_lens)
        med = {k: statistics.median(v) for k, v in times.items()}
        diff = (sides["native"]() - sides["sdpa"]()).abs().max().item()
        result["shapes"][name] = {
            "sequences": len(lens), "query_tokens": sum(q_lens), "context_tokens": sum(lens),
            **{f"{k}_ms": 1e3 * v for k, v in med.items()},
            **{f"{k}_gflops": flops / v / 1e9 for k, v in med.items()},
            "sdpa_over_native": med["sdpa"] / med["native"], "max_abs_diff": diff}
        s = result["shapes"][name]
        print(f"{name:10s} native {s['native_ms']:7.2f} ms ({s['native_gflops']:5.1f} GFLOP/s)   "
              f"sdpa {s['sdpa_ms']:7.2f} ms ({s['sdpa_gflops']:5.1f} GFLOP/s)   "
              f"{s['sdpa_over_native']:.2f}x   max |diff| {diff:.1e}")
    roofs.append(measure_roofs())
    print(f"roofs at end:   {format_roofs(roofs[1])}")
    result["roofs"] = {"start": roofs[0], "end": roofs[1]}
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
