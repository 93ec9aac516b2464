"""The device check for a lent GPU (issue 16), one prepared script that ends in under 4 minutes:

1. paged attention timings, first (so figures come back even if the tests run long), each
   kernel checked against its torch reference at the timed shape before it is timed:
   - decode, bf16, 32 query / 8 KV heads of 128, page size 256: 64 rows x 4k context and
     8 rows x 32k; the Triton kernel, the torch reference (gathers the context) and torch
     SDPA over the same K/V laid out densely (no pages: what a dense kernel reaches);
     the same for the q4 cache (codes read in place, dequantized in the kernel);
   - prefill, bf16, MMLU-shaped: 16 sequences of 512 new tokens over a 1,024-token cached
     prefix; the Triton kernel and the torch reference (SDPA per sequence on the gathered context);
   achieved memory bandwidth against the H200's 4.8 TB/s (decode) and bf16 rate against its
   990 TFLOP/s datasheet peak (prefill);
2. `pytest -m cuda tests/test_cuda_engine.py tests/test_triton_kernels.py tests/test_triton_engine.py tests/test_triton_linear.py`
   (compiled on the GPU; deterministic mode's batch invariance included),
   in parallel workers when pytest-xdist is there, with --noconftest (tests/conftest.py imports
   packages the lent machine lacks);
3. with the time left, the two Triton test files again under TRITON_INTERPRET=1.

    PYTHONPATH=. python benchmarks/gpu_check.py --out $OUT

The engine-level figures (MMLU-shaped and decode against transformers or a plain-torch Llama,
CUDA graphs against eager, deterministic mode's cost) are benchmarks/gpu_engine.py, run after this
in the same device call:

    PYTHONPATH=. python benchmarks/gpu_check.py --out $OUT; PYTHONPATH=. timeout 300 python benchmarks/gpu_engine.py --out $OUT

Writes OUT/gpu_check.json (rewritten after each part) and OUT/pytest_*.log.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
H200_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 990e12
DEADLINE_S = 225
DEV = {"device": torch.device("cuda")}      # --dry-run: the CPU under Triton's interpreter


def _paged_layer(fmt_name: str, rows: int, ctx: int, page: int, hkv: int, d: int, gen: torch.Generator):
    """Every row's context on its own shuffled pages, filled through the reference write."""
    from evalrun.kernels.ref.cache_ops import write_kv_torch
    from evalrun.kernels.kv_format import LayerKV, kv_format
    fmt = kv_format(fmt_name, window=0) if fmt_name.startswith("q") else kv_format(fmt_name)
    per_row = -(-ctx // page)
    num_pages = rows * per_row
    layer = LayerKV.allocate(fmt, num_pages + 1, page, hkv, d, DEV["device"])
    perm = torch.randperm(num_pages, generator=gen).view(rows, per_row)
    pos = torch.arange(ctx)
    for r in range(rows):
        slots = (perm[r][pos // page] * page + pos % page).to(DEV["device"])
        k, v = torch.randn(2, ctx, hkv, d, device=DEV["device"], dtype=torch.bfloat16)
        write_kv_torch(k, v, layer, slots)
    return layer, perm.tolist(), num_pages


def _ms(fn) -> float:
    import triton.testing
    if DEV["device"].type == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max())


def bench_decode(rows: int, ctx: int, fmt_name: str, hq: int = 32, hkv: int = 8, d: int = 128,
                 page: int = 256) -> dict:
    from evalrun.kernels.attention import build_metadata, decode_gather
    from evalrun.kernels.ref.attention import decode_torch
    from evalrun.kernels.cuda.triton_attention import decode_triton
    gen = torch.Generator().manual_seed(rows)
    layer, tables, null_page = _paged_layer(fmt_name, rows, ctx, page, hkv, d, gen)
    meta = build_metadata([1] * rows, [ctx] * rows, tables, page, null_page, DEV["device"])
    q = torch.randn(rows, hq, d, device=DEV["device"], dtype=torch.bfloat16)
    scale = d ** -0.5
    out, ref = decode_triton(q, layer, meta, scale), decode_torch(q, layer, meta, scale)
    res = {"rows": rows, "context": ctx, "format": fmt_name, "heads": f"{hq}/{hkv}x{d}", "page_size": page,
           "max_abs_err_vs_torch_ref": _err(out, ref)}
    res["ok"] = bool(torch.isfinite(out).all()) and res["max_abs_err_vs_torch_ref"] < 3e-2
    cache_bytes = rows * ctx * sum(t[0, 0].numel() * t.element_size() for t in layer.tensors())   # per slot
    res["bytes_read"] = cache_bytes
    res["triton_ms"] = _ms(lambda: decode_triton(q, layer, meta, scale))
    res["torch_ref_ms"] = _ms(lambda: decode_torch(q, layer, meta, scale))
    res["triton_bandwidth_TBps"] = cache_bytes / res["triton_ms"] / 1e9
    res["triton_share_of_4.8TBps"] = res["triton_bandwidth_TBps"] * 1e12 / H200_BYTES_PER_S
    if fmt_name == "bf16":      # the same K/V dense [B, Hkv, L, D]: SDPA's own kernel, no page table
        from evalrun.kernels.ref.cache_ops import gather_kv
        k, v = gather_kv(layer, decode_gather(meta)[0].view(-1), torch.bfloat16)
        k, v = (x.view(rows, ctx, hkv, d).transpose(1, 2).contiguous() for x in (k, v))
        qd = q[:, :, None]                                                                 # [B, Hq, 1, D]
        sdpa = lambda: F.scaled_dot_product_attention(qd, k, v, scale=scale, enable_gqa=True)  # noqa: E731
        res["sdpa_dense_max_abs_err_vs_torch_ref"] = _err(sdpa()[:, :, 0], ref)
        res["sdpa_dense_ms"] = _ms(sdpa)
        res["sdpa_dense_bandwidth_TBps"] = cache_bytes / res["sdpa_dense_ms"] / 1e9
    return res


def bench_prefill(seqs: int = 16, new: int = 512, cached: int = 1024, hq: int = 32, hkv: int = 8, d: int = 128,
                  page: int = 256) -> dict:
    from evalrun.kernels.attention import build_metadata
    from evalrun.kernels.backend import PlanKey, TorchKernels, TritonKernels
    gen = torch.Generator().manual_seed(0)
    ctx = cached + new
    layer, tables, null_page = _paged_layer("bf16", seqs, ctx, page, hkv, d, gen)
    meta = build_metadata([new] * seqs, [ctx] * seqs, tables, page, null_page, DEV["device"])
    q = torch.randn(seqs * new, hq, d, device=DEV["device"], dtype=torch.bfloat16)
    scale = d ** -0.5
    key = PlanKey.for_layer(q, layer)
    triton_k, torch_k = TritonKernels().plan(key), TorchKernels().plan(key)        # resolved once, as a model does
    out, ref = triton_k.attention(q, layer, meta, scale), torch_k.attention(q, layer, meta, scale)
    pairs = seqs * hq * sum(cached + i + 1 for i in range(new))          # (query, key) pairs attended
    flops = 4 * d * pairs
    res = {"sequences": seqs, "new_tokens": new, "cached_tokens": cached, "heads": f"{hq}/{hkv}x{d}",
           "max_abs_err_vs_torch_ref": _err(out, ref), "flops": flops}
    res["ok"] = bool(torch.isfinite(out).all()) and res["max_abs_err_vs_torch_ref"] < 3e-2
    res["triton_ms"] = _ms(lambda: triton_k.attention(q, layer, meta, scale))
    res["torch_ref_ms"] = _ms(lambda: torch_k.attention(q, layer, meta, scale))
    res["triton_TFLOPs"] = flops / res["triton_ms"] / 1e9
    res["triton_share_of_990TFLOPs"] = res["triton_TFLOPs"] * 1e12 / H200_BF16_FLOPS
    res["torch_ref_TFLOPs"] = flops / res["torch_ref_ms"] / 1e9
    return res


def run_pytest(name: str, args: list[str], extra_env: dict, timeout: float, out_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra_env)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", *workers, *args]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(10, timeout))
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    (out_dir / f"pytest_{name}.log").write_text(text)
    tail = [line for line in text.splitlines() if line.strip()][-15:]
    print(f"--- pytest {name}: rc={rc} in {time.time() - start:.0f}s\n" + "\n".join(tail), flush=True)
    return {"cmd": " ".join(cmd), "rc": rc, "seconds": round(time.time() - start, 1), "tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"             # before triton is imported
        DEV["device"] = torch.device("cpu")
        args.skip_tests = True
    import triton
    result: dict = {"device": torch.cuda.get_device_name() if DEV["device"].type == "cuda" else "cpu (dry run)",
                    "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]}
    path = args.out / "gpu_check.json"

    def save() -> None:
        result["elapsed_s"] = round(time.time() - start, 1)
        path.write_text(json.dumps(result, indent=1))

    if not args.skip_bench:
        parts = [("decode_bf16_64x4k", lambda: bench_decode(64, 4096, "bf16")),
                 ("decode_bf16_8x32k", lambda: bench_decode(8, 32768, "bf16")),
                 ("decode_q4_64x4k", lambda: bench_decode(64, 4096, "q4")),
                 ("prefill_bf16_16x512_over_1k", bench_prefill)]
        if args.dry_run:
            parts = [("decode_bf16", lambda: bench_decode(2, 40, "bf16", 4, 2, 32, 16)),
                     ("decode_q4", lambda: bench_decode(2, 40, "q4", 4, 2, 32, 16)),
                     ("prefill_bf16", lambda: bench_prefill(2, 20, 13, 4, 2, 32, 16))]
        for key, fn in parts:
            t = time.time()
            try:
                if args.dry_run:
                    from evalrun.kernels.cuda.triton_interpreter import interpreter_scalars
                    with interpreter_scalars():
                        result[key] = fn()
                else:
                    result[key] = fn()
            except Exception as e:          # one failing part must not lose the others
                result[key] = {"error": repr(e)[:2000]}
            result[key]["wall_s"] = round(time.time() - t, 1)
            if DEV["device"].type == "cuda":
                torch.cuda.empty_cache()
            print(key, json.dumps(result[key]), flush=True)
            save()
    if not args.skip_tests:
        left = DEADLINE_S - (time.time() - start)
        result["pytest_cuda"] = run_pytest("cuda", ["-m", "cuda", "tests/test_cuda_engine.py",
                                                    "tests/test_triton_kernels.py", "tests/test_triton_engine.py", "tests/test_triton_linear.py"],
                                           {}, left - 30, args.out)
        save()
        left = DEADLINE_S - (time.time() - start)
        if left > 40:
            result["pytest_interpreter"] = run_pytest("interpreter", ["tests/test_triton_kernels.py",
                                                                      "tests/test_triton_engine.py",
                                                                      "tests/test_triton_linear.py"],
                                                      {"TRITON_INTERPRET": "1"}, left - 5, args.out)
        save()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
