"""Decode speed of the model families against a Llama of the same sizes (issue 40, item 2).

Random-weight models built with transformers, all of SmolLM2-135M's sizes (30 layers, hidden 576,
9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152): a Llama, a Qwen3 (q/k norms) and a
Gemma 3 (its four norms per layer, q/k norms, GeGLU, scaled embeddings, five sliding layers of each
six with a window of 512 and their own rope base). Each decodes the same 32 HumanEval prompts x 128
new tokens (greedy, EOS banned) through DynamicGenerator, in rounds that alternate the models in one
process (ABC then CBA ...); the figure is each family's tokens/s over the Llama's in the same round
(median over rounds). The kernel plan each ran is printed and recorded: a name of "torch" for any op
means that op fell back to the torch reference.

    python -m benchmarks.bench_families [--dtype auto] [--rounds 3] [--n 32] [--new-tokens 128]
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks import bench_decode
from benchmarks.bench_decode import humaneval_prompts, run_ours
from benchmarks.common import CACHE_MODE, base_parser, describe_dtype, dtype_fields, positive_int, start_run, write_result
from evalrun.demo import default_cache_dir
from evalrun.engine import Model, Tokenizer
from evalrun.engine.cache import resolve_format

SIZES = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
             head_dim=64, intermediate_size=1536, max_position_embeddings=8192, tie_word_embeddings=True)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 512, "query_pre_attn_scalar": 64}),
}
# plan entries that are not kernels (what the stream is, whether graphs or the step are on)
NOT_KERNELS = {"stream", "cuda_graphs", "decode_step"}


def build(family: str, root: Path) -> Path:
    """The family's random model at SmolLM2's sizes (made once, kept under root)."""
    import transformers
    path = root / f"{family}-135m-shaped"
    if (path / "config.json").is_file():
        return path
    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**SIZES, **extra)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def decode(model: Model, tokenizer: Tokenizer, prompts: list[list[int]], decode_args: Any) -> dict[str, Any]:
    """bench_decode's run of ours (EOS banned for the T tokens, a prefaulted cache) on this model."""
    run = run_ours(decode_args, model, tokenizer, prompts)
    tokens = sum(len(c) for c in run["completions"])
    page = decode_args.page_size
    plan = model.kernel_plan(resolve_format(CACHE_MODE[decode_args.dtype], page), page).describe()
    return {"seconds": run["seconds"], "tokens": tokens, "tokens_per_s": tokens / run["seconds"], "plan": plan}


def fallbacks(plan: dict[str, str]) -> list[str]:
    """The plan's ops that run the torch reference."""
    return sorted(op for op, name in plan.items() if op not in NOT_KERNELS and name.startswith("torch"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = base_parser("bench_families", __doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--n", type=positive_int, default=32, help="HumanEval prompts (default 32)")
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--models-dir", type=Path, default=default_cache_dir() / "bench-families",
                        help="where the random models are made once (default: $EVALRUN_CACHE/bench-families)")
    args = parser.parse_args(argv)
    info, _, tokenizer = start_run()
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.n)]
    args.models_dir.mkdir(parents=True, exist_ok=True)
    models = {f: Model.load(build(f, args.models_dir), dtype=args.dtype) for f in FAMILIES}
    runs_args = bench_decode.parse_args(["--dtype", args.dtype, "--n", str(args.n), "--new-tokens", str(args.new_tokens)])
    warm_args = bench_decode.parse_args(["--dtype", args.dtype, "--n", "2", "--new-tokens", "4"])
    print(f"decode: {len(prompts)} HumanEval prompts x {args.new_tokens} new tokens, {describe_dtype(args)}, "
          f"{args.rounds} rounds, families alternating")
    for f, m in models.items():                                          # warm-up: builds, first-touch pages
        decode(m, tokenizer, prompts[:2], warm_args)
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in FAMILIES}
    for r in range(args.rounds):
        order = list(FAMILIES) if r % 2 == 0 else list(reversed(FAMILIES))
        for f in order:
            runs[f].append(decode(models[f], tokenizer, prompts, runs_args))
        print(f"  round {r}: " + ", ".join(f"{f} {runs[f][-1]['tokens_per_s']:.1f} tok/s" for f in FAMILIES))
    result: dict[str, Any] = {"benchmark": "families-decode", "machine": info, **dtype_fields(args),
                              "n": len(prompts), "new_tokens": args.new_tokens, "families": {}}
    for f in FAMILIES:
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[f], runs["llama"])]
        plan = runs[f][-1]["plan"]
        result["families"][f] = {"tokens_per_s": [x["tokens_per_s"] for x in runs[f]],
                                 "ratio_to_llama": statistics.median(ratios), "rounds": ratios, "plan": plan,
                                 "torch_fallbacks": fallbacks(plan)}
        print(f"{f:8s} {statistics.median(x['tokens_per_s'] for x in runs[f]):7.1f} tok/s  "
              f"{statistics.median(ratios):.3f} of the Llama's (rounds {', '.join(f'{x:.3f}' for x in ratios)})  "
              f"torch fallbacks: {', '.join(fallbacks(plan)) or 'none'}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
