"""Where a decode step's time goes (issue 12, item 2): wall time per op class at R rows, and the
linears' GFLOP/s against this machine's sgemm roof measured in the same run.

R distinct --context-token windows (default 128) of the HumanEval prompts are prefilled, then --steps pure decode
steps are timed (after a few warm-up steps). Inside the native decode step
(evalrun/kernels/cpu/decode_step.py) the C code times each stage summed over the layers; the LM head,
sampling and the rest of the step (metadata, embedding, Python) are timed around it here.
Steps that do not take the native path (another cache mode or dtype, EVALRUN_DECODE_STEP=0)
are reported as one "layers (per-op path)" figure.

This machine's clock moves by 20-30% within a minute, so a roof measured at the start and the
end alone does not say how close the steps came to it. The steps are therefore timed in
--blocks blocks, each right after its own sgemm roof measurement, and the linears' share of
the roof is also reported per block (median and range): each block's figure against the roof
measured next to it.

    python -m benchmarks.decode_profile [--rows 32] [--steps 40] [--blocks 8] [--context 128] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.decode_curve import curve_prompts
from benchmarks.common import warm_up_ours, write_result
from benchmarks.machine_roofs import best_roofs, format_roofs, measure_roofs_in, model_work, sgemm_gflops
from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache, Tokenizer
from evalrun.engine import generator as generator_module
from evalrun.demo import ensure_demo_model
from evalrun.kernels.cpu import decode_step

LINEAR_STAGES = ("qkv", "o_proj", "gate_up", "down")


class _Timer:
    """Wall seconds spent inside one function, installed by monkey-patching a module attribute."""

    def __init__(self, owner: Any, name: str):
        self.owner, self.name, self.seconds = owner, name, 0.0
        self.real = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return self.real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.real)


def profile_steps(model: Model, tokenizer: Tokenizer, rows: int, steps: int, warm: int = 4,
                  blocks: int = 1, roof_n: int = 2048, mode: str = "fp32", context: int = 128) -> dict[str, Any]:
    """Per-stage ms per step over `steps` steps, timed in `blocks` blocks; with blocks > 1 each
    block is preceded by an sgemm roof measurement (roof_n^3) and its figures are kept apart.
    Each row's prompt is `context` tokens."""
    prompts = curve_prompts(tokenizer, rows, context)
    pages = -(-(context + steps + warm + 4) // 256)
    cache = PagedCache(model, max_tokens=rows * pages * 256, page_size=256, mode=mode)
    gen = DynamicGenerator(model, cache, tokenizer)
    gen.enqueue([DynamicJob(ids, max_new_tokens=steps + warm + 4, identifier=i) for i, ids in enumerate(prompts)])
    started: set[int] = set()
    while True:                                        # until every prompt is prefilled and decoding
        results = gen.iterate()
        started.update(r["identifier"] for r in results)
        if len(started) == rows and len(results) == rows:
            break
    for _ in range(warm):
        gen.iterate()
    head = _Timer(model, "_head")
    # sampling: the logits rows' finite check (with the greedy argmax, check_rows) and the choice
    sample, check = _Timer(generator_module, "choose_tokens"), _Timer(generator_module, "check_rows")
    stages: dict[str, float] = {}
    wall, per_block = 0.0, []
    bounds = [steps * b // blocks for b in range(blocks + 1)]
    try:
        for b in range(blocks):
            n = bounds[b + 1] - bounds[b]
            if n == 0:
                continue
            roof = sgemm_gflops(roof_n, repeat=2, dtype=model.dtype) if blocks > 1 else None
            head_s = head.seconds
            decode_step.profile(True)
            t = time.perf_counter()
            for _ in range(n):
                gen.iterate()
            wall += time.perf_counter() - t
            block = decode_step.profile(False)
            for name, v in block.items():
                stages[name] = stages.get(name, 0.0) + v
            per_block.append({"steps": n, "roof_gflops": roof,
                              "linear_s": sum(block.get(name, 0.0) for name in LINEAR_STAGES),
                              "head_s": head.seconds - head_s})
    finally:
        head.restore()
        sample.restore()
        check.restore()
    ms = {name: 1e3 * s / steps for name, s in stages.items()}
    native = sum(ms.values()) > 0
    ms["lm_head (+ final norm)"] = 1e3 * head.seconds / steps
    ms["sampling"] = 1e3 * (sample.seconds + check.seconds) / steps
    ms["other (metadata, embedding, Python)"] = 1e3 * wall / steps - sum(ms.values())
    if not native:
        ms = {"layers (per-op path)": ms.pop("other (metadata, embedding, Python)"), **ms}
    return {"rows": rows, "steps": steps, "ms_per_step": 1e3 * wall / steps, "ms": ms, "native_step": native,
            "blocks": per_block if blocks > 1 else []}


def report(p: dict[str, Any], work: dict[str, float], roofs: dict[str, Any]) -> dict[str, Any]:
    rows, ms = p["rows"], p["ms"]
    print(f"\n{rows} rows: {p['ms_per_step']:.1f} ms per decode step ({p['steps']} steps"
          f"{'' if p['native_step'] else ', per-op path'})")
    for name, v in ms.items():
        print(f"  {name:38s} {v:7.2f} ms  {v / p['ms_per_step']:5.1%}")
    out = dict(p)
    if p["native_step"]:
        lin_ms = sum(ms[s] for s in LINEAR_STAGES)
        body = rows * work["body_flops_per_token"] / (lin_ms / 1e3) / 1e9
        head = rows * work["head_flops_per_token"] / (ms["lm_head (+ final norm)"] / 1e3) / 1e9
        both = rows * (work["body_flops_per_token"] + work["head_flops_per_token"]) / (
            (lin_ms + ms["lm_head (+ final norm)"]) / 1e3) / 1e9
        roof = roofs["sgemm_gflops"]
        print(f"  linears: layers {body:.1f} GFLOP/s ({body / roof:.0%} of the sgemm roof), LM head {head:.1f} "
              f"({head / roof:.0%}), all {both:.1f} ({both / roof:.0%})")
        out["linear_gflops"] = {"layers": body, "lm_head": head, "all": both, "roof": roof}
        shares = block_shares(p["blocks"], rows, work)
        if shares:
            out["linear_share_by_block"] = shares
            for key, label in (("layers", "layers"), ("all", "all linears")):
                v = sorted(x[key] for x in shares)
                print(f"  {label} against the roof measured next to each block ({len(v)} blocks): median "
                      f"{statistics.median(v):.0%}, range {v[0]:.0%}-{v[-1]:.0%}")
    return out


def block_shares(blocks: list[dict[str, Any]], rows: int, work: dict[str, float]) -> list[dict[str, float]]:
    """Each block's linears GFLOP/s over the sgemm roof measured just before it."""
    out = []
    for b in blocks:
        if not b["roof_gflops"] or b["linear_s"] <= 0 or b["head_s"] <= 0:
            continue
        body = b["steps"] * rows * work["body_flops_per_token"] / b["linear_s"] / 1e9
        both = b["steps"] * rows * (work["body_flops_per_token"] + work["head_flops_per_token"]) / (
            b["linear_s"] + b["head_s"]) / 1e9
        out.append({"roof_gflops": b["roof_gflops"], "layers_gflops": body, "all_gflops": both,
                    "layers": body / b["roof_gflops"], "all": both / b["roof_gflops"]})
    return out




def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="32", help="comma-separated row counts (default 32)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--context", type=int, default=128, help="prompt tokens per row (default 128)")
    p.add_argument("--blocks", type=int, default=8,
                   help="time the steps in this many blocks, each after its own sgemm roof (default 8; 1: none)")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model dtype (its cache mode: fp32 / bf16); the linears' roof is torch's matmul "
                        "in this dtype (bfloat16: the bf16 matmul roof, reported under sgemm_gflops)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    model_dir = a.model or ensure_demo_model()
    dtype, mode = getattr(torch, a.dtype), {"float32": "fp32", "bfloat16": "bf16"}[a.dtype]
    roofs = measure_roofs_in(dtype)
    print(f"roofs at start: {format_roofs(roofs)}")
    tokenizer = Tokenizer.load(model_dir)
    model = Model.load(model_dir, dtype=a.dtype)
    warm_up_ours(model, tokenizer, mode, 256, "def f(x):")
    points = [profile_steps(model, tokenizer, int(r), a.steps, blocks=max(1, a.blocks), mode=mode,
                            context=a.context)
              for r in a.rows.split(",")]
    end = measure_roofs_in(dtype)
    print(f"roofs at end:   {format_roofs(end)}")
    roofs = best_roofs(roofs, end)
    work = model_work(model_dir)
    result = {"dtype": a.dtype, "roofs": roofs, "threads": torch.get_num_threads(),
              "points": [report(pt, work, roofs) for pt in points]}
    if a.out:
        write_result(a.out, result)
    return result


if __name__ == "__main__":
    main()
