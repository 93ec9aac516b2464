"""Small-M float32 linears on CPU (issue 12): GFLOP/s of each exact path at decode shapes, against
the machine's measured large-sgemm roof, and whether each path is batch-invariant (a row's output
bitwise equal whatever the number of rows beside it).

    python -m benchmarks.bench_linear [--rows 1,8,32,64,128,256] [--model DIR] [--repeat 30]

Shapes: SmolLM2-135M's fused QKV, output, gate/up, down projections and the LM head (or those of
--model). Each variant runs --repeat calls in a block after a warm-up, the variants alternate
for --rounds rounds, and a variant's figure is its best round's median. (Alternating single
calls would charge each path for the previous one's idle threads: torch's OpenMP workers and
the native pool both spin briefly after a call, and on two cores they take each other's time.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import write_result
from evalrun.kernels.cpu import gemm
from evalrun.kernels.cpu.linear import linear_gemm, linear_onednn
from evalrun.kernels.linear import Linear, linear, onednn_available

Variant = Callable[[torch.Tensor], torch.Tensor]


def sgemm_roof(n: int = 2048, repeat: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / min(times) / 1e9


def shapes(model_dir: Path | None) -> dict[str, tuple[int, int]]:
    """name -> (out, in) of each linear of one layer, plus the LM head."""
    if model_dir is None:
        h, i, q, kv, v = 576, 1536, 576, 192, 49152
    else:
        cfg = json.loads((model_dir / "config.json").read_text())
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        d = cfg.get("head_dim", h // cfg["num_attention_heads"])
        q, kv, v = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["vocab_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (v, h)}


def variants(w: torch.Tensor) -> dict[str, Variant]:
    wt = w.t().contiguous()                                  # [in, out]
    out: dict[str, Variant] = {"F.linear": lambda x: F.linear(x, w)}
    if gemm.available():
        native = Linear(w, panels=gemm.pack(w), kernel=linear_gemm)
        in_use = gemm.width()                               # the CPU's widest, or EVALRUN_GEMM_WIDTH's

        def at_width(bits: int) -> Variant:
            def call(x: torch.Tensor) -> torch.Tensor:
                gemm.set_width(bits)
                try:
                    return linear(x, native)
                finally:
                    gemm.set_width(in_use)
            return call
        out["native-gemm"] = at_width(in_use)
        if in_use == 512:                                   # the AVX2 tiles on an AVX-512 CPU
            out["native-256"] = at_width(256)
    if onednn_available():
        onednn = Linear(w, packed=torch.ops.mkldnn._reorder_linear_weight(w, None), kernel=linear_onednn)
        out["onednn-packed"] = lambda x: linear(x, onednn)
    out["x@wT(contig)"] = lambda x: torch.mm(x, wt)
    out["(w@xT)T"] = lambda x: torch.mm(w, x.t()).t().contiguous()
    return out


def time_call(fn: Variant, x: torch.Tensor, repeat: int) -> float:
    fn(x)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_variants(vs: dict[str, Variant], x: torch.Tensor, repeat: int, rounds: int) -> dict[str, float]:
    """Seconds per call of each variant: blocks of `repeat` calls, alternated `rounds` times,
    the best round's median."""
    best = {v: float("inf") for v in vs}
    for _ in range(rounds):
        for v, fn in vs.items():
            best[v] = min(best[v], time_call(fn, x, repeat))
    return best


def batch_invariant(fn: Variant, w: torch.Tensor, rows: list[int]) -> bool:
    """Row 0's output bitwise equal for every M in rows."""
    x = torch.randn(max(rows), w.shape[1], generator=torch.Generator().manual_seed(0))
    ref = fn(x[:1])[0]
    return all(torch.equal(fn(x[:m])[0], ref) for m in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64,128,256")
    p.add_argument("--model", type=Path)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    roof = sgemm_roof()
    print(f"threads {torch.get_num_threads()}, large-sgemm roof {roof:.1f} GFLOP/s")
    result: dict = {"roof_gflops": roof, "threads": torch.get_num_threads(), "shapes": {}}
    for name, (n_out, n_in) in shapes(a.model).items():
        w = torch.randn(n_out, n_in) * 0.02
        vs = variants(w)
        inv = {v: batch_invariant(fn, w, rows) for v, fn in vs.items()}
        result["shapes"][name] = {"out": n_out, "in": n_in, "batch_invariant": inv, "gflops": {}}
        print(f"\n{name} [{n_out} x {n_in}]  batch-invariant: " + ", ".join(f"{v} {ok}" for v, ok in inv.items()))
        for m in rows:
            x = torch.randn(m, n_in)
            secs = time_variants(vs, x, a.repeat, a.rounds)
            g = {v: 2 * m * n_in * n_out / t / 1e9 for v, t in secs.items()}
            result["shapes"][name]["gflops"][m] = g
            print(f"  M={m:<4} " + "  ".join(f"{v} {x:6.1f} ({x / roof:4.0%})" for v, x in g.items()))
    if a.out:
        write_result(a.out, result)


if __name__ == "__main__":
    main()
