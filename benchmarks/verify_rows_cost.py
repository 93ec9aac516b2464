"""What checking k draft tokens of one sequence costs against one plain decode step (issue 14's
"decode rows or the prefill path: measure which is faster"), SmolLM2 float32 after a 300-token prompt:

- decode rows: the k tokens as k rows of the decode group, each its own pseudo-sequence over the
  sequence's pages (the verification that gives bitwise the logits of one step at a time,
  tests/test_verify_rows.py), so the native whole-step path runs;
- prefill chunk: the k tokens as one chunk of the sequence (the prefill path).

    python -m benchmarks.verify_rows_cost [--rows 5,9] [--rounds 7] [--out FILE]

The forms alternate for --rounds rounds of 5 forwards each; figures are medians, as multiples of
one decode step of 1 row.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.common import DEFAULT_OUT_DIR, machine_info, positive_int, print_machine, write_result
from evalrun.engine import Model, PagedCache
from evalrun.engine.model import ForwardBatch
from evalrun.kernels.attention import build_metadata

NAME = "verify_rows_cost"
PROMPT, PAGE = 300, 256


def forward(model: Model, cache: PagedCache, ids: list[int], start: int, table: list[int], as_rows: bool) -> torch.Tensor:
    """Tokens `ids` at positions start.. of one sequence on pages `table`: as decode rows (one
    pseudo-sequence each) or as one chunk; logits of every token."""
    k, ps, cpu = len(ids), cache.page_size, torch.device("cpu")
    pos = list(range(start, start + k))
    meta = (build_metadata([1] * k, [p + 1 for p in pos], [table] * k, ps, cache.null_page, cpu) if as_rows
            else build_metadata([k], [start + k], [table], ps, cache.null_page, cpu))
    batch = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.tensor(pos),
                         slot_mapping=torch.tensor([table[p // ps] * ps + p % ps for p in pos]),
                         attn=meta, logits_indices=torch.arange(k))
    return model.forward(batch, cache)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="5,9", help="draft sizes + 1 to time (default 5,9)")
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / f"{NAME}.json")
    args = parser.parse_args(argv)
    info = machine_info()
    print_machine(info)
    from evalrun.demo import ensure_demo_model
    model = Model.load(ensure_demo_model(), dtype="float32")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=g).tolist()
    table = [0, 1]
    cache = PagedCache(model, max_tokens=PAGE * 4, page_size=PAGE, mode="fp32")
    forward(model, cache, prompt, 0, table, as_rows=False)
    forms = [("decode step, 1 row", 1, True)]
    for k in (int(x) for x in args.rows.split(",")):
        forms += [(f"decode rows x{k}", k, True), (f"prefill chunk x{k}", k, False)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in forms}
    for r in range(args.rounds):
        for name, k, as_rows in (forms if r % 2 == 0 else forms[::-1]):
            ids = prompt[:k]                       # written over the same positions every time
            t = time.perf_counter()
            for _ in range(5):
                forward(model, cache, ids, PROMPT, table, as_rows)
            times[name].append((time.perf_counter() - t) / 5)
    base = statistics.median(times[forms[0][0]])
    result = {"benchmark": NAME, "machine": info, "forms": {}}
    for name, _, _ in forms:
        med = statistics.median(times[name])
        result["forms"][name] = {"ms": 1e3 * med, "x_one_step": med / base}
        print(f"{name:22s} {1e3 * med:7.2f} ms  {med / base:5.2f}x one decode step")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
