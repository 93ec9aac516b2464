"""Builds of the bf16 GEMM (evalrun/kernels/cpu/csrc/gemm_bf16.c) against each other on a decode
step's linears, alternated in one process: how a tuning macro or an old copy of the source compares.

    python -m benchmarks.ab_gemm_bf16 --variants "base=;kc128=-DBF_KC=128;old=@/tmp/gemm_bf16.c" \
        [--rows 32] [--trials 21] [--shapes 960x576,576x576,3072x576,576x1536] [--layers 30] [--hot]

Every variant runs the same sequence of calls (--layers copies of --shapes, N x K, each layer its own
weights, packed on huge pages as the engine packs them: 212 MB for SmolLM2-135M's 30 layers, so the
weights stream from memory as in a decode step; --hot: one layer's weights reused, in cache). A
trial is one pass of every call; the variants alternate (reversed every other trial) and each
variant's figure is the median over the trials, with the median of its per-trial ratio to the
first variant. The outputs of all variants must be bitwise equal (the chain is fixed) or it stops.
This machine's speed drifts by tens of percent within minutes: only the paired ratios compare.
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
from evalrun.kernels.cpu import gemm_bf16, huge_pages, native

NAME = "ab_gemm_bf16"
SOURCE = native.CSRC / "gemm_bf16.c"
USED = ("gemm_bf16", "gemm_bf16_pack", "gemm_bf16_packed_u16")     # what every version of the source has


def shapes_arg(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"expected N x K shapes like 960x576,576x1536, got {text!r}")
    return out  # type: ignore[return-value]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--variants", type=kernel_builds.parse_variants, required=True,
                   help="NAME=DEFINES[@SOURCE];... the first is the baseline of the ratios")
    p.add_argument("--rows", type=positive_int, default=32)
    p.add_argument("--trials", type=positive_int, default=21)
    p.add_argument("--shapes", type=shapes_arg, default=shapes_arg("960x576,576x576,3072x576,576x1536"))
    p.add_argument("--layers", type=positive_int, default=30)
    p.add_argument("--hot", action="store_true", help="one layer's weights for every layer (in cache)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / f"{NAME}.json")
    return p.parse_args(argv)


def calls(args: argparse.Namespace, lib: Any) -> list[tuple[int, int, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out: list[tuple[int, int, torch.Tensor]] = []
    for layer in range(args.layers):
        for i, (n, k) in enumerate(args.shapes):
            if args.hot and layer:
                out.append(out[i])
                continue
            w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
            panels = huge_pages.empty((lib.gemm_bf16_packed_u16(n, k),), torch.int16)
            lib.gemm_bf16_pack(w.view(torch.int16).data_ptr(), n, k, panels.data_ptr())
            out.append((n, k, panels))
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    info = machine_info()
    print_machine(info)
    tmp = tempfile.TemporaryDirectory()
    libs = {v.name: kernel_builds.build_variant(v, SOURCE, Path(tmp.name), {f: gemm_bf16.SIGNATURES[f] for f in USED}) for v in args.variants}
    work = calls(args, next(iter(libs.values())))
    m, nth = args.rows, torch.get_num_threads()
    xs = {k: torch.randn(m, k) for _, k in args.shapes}
    ys = {n: torch.empty(m, n) for n, _ in args.shapes}

    def one_pass(lib: Any) -> torch.Tensor:
        for n, k, panels in work:
            if lib.gemm_bf16(xs[k].data_ptr(), 0, m, k, k, panels.data_ptr(), n, None, None, ys[n].data_ptr(), 0, nth):
                raise SystemExit(f"gemm_bf16 refused {m}x{n}x{k}")
        return torch.cat([y.flatten() for y in ys.values()])

    first = {name: one_pass(lib) for name, lib in libs.items()}
    base = args.variants[0].name
    for name, y in first.items():
        if not torch.equal(y.view(torch.int32), first[base].view(torch.int32)):
            raise SystemExit(f"variant {name} does not give the bits of {base}")
    times: dict[str, list[float]] = {name: [] for name in libs}
    for t in range(args.trials):
        for name in (list(libs) if t % 2 == 0 else list(reversed(list(libs)))):
            start = time.perf_counter()
            one_pass(libs[name])
            times[name].append(time.perf_counter() - start)
    flops = sum(2 * m * n * k for n, k, _ in work)
    result: dict[str, Any] = {"benchmark": NAME, "machine": info, "config": {
        "variants": [vars(v) | {"source": str(v.source or SOURCE)} for v in args.variants], "rows": m,
        "trials": args.trials, "shapes": args.shapes, "layers": args.layers, "hot": args.hot, "threads": nth},
        "variants": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        paired = statistics.median(a / b for a, b in zip(ts, times[base]))
        result["variants"][name] = {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3, "gflops": flops / med / 1e9,
                                    "paired_vs_first": paired}
        print(f"{name:12s} median {med * 1e3:7.2f} ms  min {min(ts) * 1e3:7.2f} ms  {flops / med / 1e9:6.1f} GFLOP/s  "
              f"paired vs {base} {paired:.3f}")
    write_result(args.out, result)
    tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
