"""Builds of paged decode attention (evalrun/kernels/cpu/csrc/paged_decode.c) against each other on a
decode step's attention, alternated in one process: how a tuning macro or an old copy compares.

    python -m benchmarks.ab_decode_attention --variants "new=;old=@/tmp/old/paged_decode.c" \
        [--rows 32] [--context 470] [--layers 30] [--kv fp32] [--trials 15]

A trial is one call per layer for --layers layers, each its own pages (SmolLM2's 3 KV heads of 64, 9
query heads, pages of 256 on 2 MiB pages as the engine allocates them, in a shuffled order), --rows
sequences of --context positions: the K/V stream from memory as in a decode step. The variants
alternate (reversed every other trial); each one's figure is its median seconds per trial, with the
K/V bytes over it, and the median of its per-trial ratio to the first. Their outputs must be bitwise
equal or it stops. A variant's source is compiled as native.py compiles the tree's: its `#include "..."`
headers resolve next to that source first, then in the tree's csrc/, so an old copy needs the old
headers it changed beside it. This machine's speed drifts by tens of percent within minutes: only
the paired ratios compare.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks import kernel_builds
from benchmarks.common import DEFAULT_OUT_DIR, machine_info, positive_int, print_machine, write_result
from evalrun.kernels.cpu import native, paged_decode
from evalrun.kernels.kv_format import LayerKV, kv_format

NAME = "ab_decode_attention"
SOURCE = native.CSRC / "paged_decode.c"
HQ, HKV, D, PAGE = 9, 3, 64, 256


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--variants", type=kernel_builds.parse_variants, required=True,
                   help="NAME=DEFINES[@SOURCE];... the first is the baseline of the ratios")
    p.add_argument("--rows", type=positive_int, default=32)
    p.add_argument("--context", type=positive_int, default=470, help="positions per sequence (default 470)")
    p.add_argument("--layers", type=positive_int, default=30)
    p.add_argument("--kv", choices=("fp32", "bf16"), default="fp32", help="the pages' format (default fp32)")
    p.add_argument("--trials", type=positive_int, default=15)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / f"{NAME}.json")
    return p.parse_args(argv)


def layers(args: argparse.Namespace) -> tuple[list[LayerKV], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the layers' pages, the page table [rows, pages], the lengths, q [rows, HQ, D])."""
    g = torch.Generator().manual_seed(0)
    per_row = -(-args.context // PAGE)
    out = []
    for _ in range(args.layers):
        layer = LayerKV.allocate(kv_format(args.kv), args.rows * per_row + 1, PAGE, HKV, D, torch.device("cpu"))
        for t in (layer.k, layer.v):
            t[:-1].copy_(torch.randn(t[:-1].shape, generator=g))
        out.append(layer)
    table = torch.randperm(args.rows * per_row, generator=g).view(args.rows, per_row).to(torch.int32).contiguous()
    lens = torch.full((args.rows,), args.context, dtype=torch.int32)
    return out, table, lens, torch.randn(args.rows, HQ, D, generator=g)


def runner(lib: Any, kv: list[LayerKV], table: torch.Tensor, lens: torch.Tensor, q: torch.Tensor,
           out: torch.Tensor) -> Any:
    """One trial's calls of `lib`, as kernels/cpu/paged_decode.py makes them (no window, no soft-capping)."""
    rows, lmax = q.shape[0], int(lens.max())
    threads = paged_decode.num_threads(rows, lmax, HQ, D)
    scratch = torch.empty(threads * (HQ * lmax + HQ * D + 64 * D + HQ))
    k_kind, v_kind = paged_decode.kinds(kv[0])

    def trial() -> None:
        for i, layer in enumerate(kv):
            rc = lib.paged_decode(q.data_ptr(), layer.k.data_ptr(), layer.v.data_ptr(), None, None, k_kind, v_kind,
                                  layer.fmt.group_size, table.data_ptr(), table.shape[1], lens.data_ptr(),
                                  out[i].data_ptr(), rows, HQ, HKV, D, PAGE, D ** -0.5, scratch.data_ptr(), lmax,
                                  threads, None, None, 0, 0, None, None, 0, 0.0)
            if rc != 0:
                raise SystemExit(f"paged_decode refused the shapes (rc {rc})")
    return trial


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    info = machine_info()
    print_machine(info)
    kv, table, lens, q = layers(args)
    nbytes = sum(layer.k[0, 0].nbytes * 2 for layer in kv) * args.rows * args.context
    with tempfile.TemporaryDirectory() as tmp:
        libs = {v.name: kernel_builds.build_variant(v, SOURCE, Path(tmp), paged_decode.SIGNATURES)
                for v in args.variants}
        outs = {name: torch.empty(args.layers, args.rows, HQ, D) for name in libs}
        trials = {name: runner(lib, kv, table, lens, q, outs[name]) for name, lib in libs.items()}
        for name, trial in trials.items():
            trial()
        first = args.variants[0].name
        for name in libs:
            if not torch.equal(outs[name], outs[first]):
                raise SystemExit(f"variant {name}'s outputs differ from {first}'s")
        seconds: dict[str, list[float]] = {name: [] for name in libs}
        for t in range(args.trials):
            for name in (list(libs) if t % 2 == 0 else list(libs)[::-1]):
                start = time.perf_counter()
                trials[name]()
                seconds[name].append(time.perf_counter() - start)
    result: dict[str, Any] = {"benchmark": NAME, "machine": info, "config": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "variants"},
        "variants": {v.name: {"defines": v.defines, "source": str(v.source or SOURCE)} for v in args.variants},
        "kv_bytes_per_trial": nbytes, "results": {}}
    for name, s in seconds.items():
        med = statistics.median(s)
        ratio = statistics.median(a / b for a, b in zip(s, seconds[first]))
        result["results"][name] = {"median_s": med, "gbps": nbytes / med / 1e9, "ratio_to_first": ratio}
        print(f"{name:12s} {1e3 * med:7.1f} ms per trial  {nbytes / med / 1e9:5.1f} GB/s  "
              f"time / {first}'s: {ratio:.3f}")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
