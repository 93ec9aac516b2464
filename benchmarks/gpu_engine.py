"""Engine-level figures on a lent GPU (issue 16 items 3 and 4): our engine against a baseline on
the same random-weight model, token ids and GPU, in one run.

The model: a Llama of a 1B (default) or 8B shape with random bf16 weights (std 0.02), written as
an HF directory (config.json + model.safetensors) in a temp folder: the lent machine has no
network and no checkpoints. The baseline is transformers' LlamaForCausalLM when it imports, else
`DenseLlama` below (the same maths in plain torch: dense KV cache, SDPA), named in the output.

    1. MMLU-shaped scoring: 4 groups x 40 prompts, each a shared 600-token prefix plus its own
       110-token question (random ids); next-token logits at the last position. Ours: every job
       queued at once (prefix computed once per group). Baseline: length-sorted batches of 8,
       right-padded, the whole prompt each time (as lm-evaluation-harness does).
    2. Decode: 32 prompts of 128 tokens x 128 greedy new tokens. Ours with CUDA graphs and with
       --eager; baseline generate (or DenseLlama's loop).
    3. Deterministic mode (item 4): ours with deterministic=True against the default on 1 and 2
       (the cost), and a job alone against the same job among the others: bitwise.
Agreement: argmax of the scored logits, greedy tokens per prompt, max |d log-prob| at the argmax.

    PYTHONPATH=. python benchmarks/gpu_engine.py --out $OUT [--shape 1b|8b] [--dry-run]

--dry-run: a tiny shape on the CPU in float32 (checks the script, times nothing meaningful).
Writes OUT/gpu_engine.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=5632, vocab_size=32000),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}


def make_model_dir(path: Path, shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Path:
    """A random-weight Llama checkpoint at `path` (HF layout)."""
    from safetensors.torch import save_file
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
           "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."), **shape}
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*size: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=device) * std).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": w(v, h, std=1.0), "model.norm.weight": torch.ones(h, dtype=dtype),
               "lm_head.weight": w(v, h)}
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                    p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                    p + "mlp.down_proj.weight": w(h, i), p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


class DenseLlama:
    """The baseline when transformers is missing: HF Llama's maths in plain torch (a dense KV cache
    [B, Hkv, L, D], SDPA with GQA, default RoPE), on the same checkpoint."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        from safetensors.torch import load_file
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.w = {k: t.to(device=device, dtype=dtype) for k, t in load_file(str(model_dir / "model.safetensors")).items()}
        c = self.cfg
        self.hq, self.hkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.d = c["hidden_size"] // self.hq
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, self.d, 2, device=device).float() / self.d))
        ang = torch.outer(torch.arange(c["max_position_embeddings"], device=device).float(), inv)
        self.cos, self.sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        self.dtype, self.device = dtype, device

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"])).to(x.dtype) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:       # x [B, H, T, D]
        cos, sin = self.cos[pos][:, None].to(x.dtype), self.sin[pos][:, None].to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, cache: Optional[list] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids, pos [B, T]; cache: per layer [k, v] of [B, Hkv, L, D] grown in place (None: no cache);
        mask [B, 1, T, L] bool or None (causal). Returns logits [B, T, V] float32."""
        b, t = ids.shape
        x = self.w["model.embed_tokens.weight"][ids]
        for n in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{n}."
            h = self._norm(x, self.w[p + "input_layernorm.weight"])
            q = (h @ self.w[p + "self_attn.q_proj.weight"].T).view(b, t, self.hq, self.d).transpose(1, 2)
            k = (h @ self.w[p + "self_attn.k_proj.weight"].T).view(b, t, self.hkv, self.d).transpose(1, 2)
            v = (h @ self.w[p + "self_attn.v_proj.weight"].T).view(b, t, self.hkv, self.d).transpose(1, 2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            if cache is not None:
                if len(cache) <= n:
                    cache.append([k, v])
                else:
                    cache[n] = [torch.cat([cache[n][0], k], 2), torch.cat([cache[n][1], v], 2)]
                k, v = cache[n]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                               enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(b, t, -1) @ self.w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, self.w[p + "post_attention_layernorm.weight"])
            gate, up = h @ self.w[p + "mlp.gate_proj.weight"].T, h @ self.w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T
        return (self._norm(x, self.w["model.norm.weight"]).float() @ self.w["lm_head.weight"].float().T)


class Baseline:
    """transformers when it imports, else DenseLlama: last-position logits of padded batches, and
    greedy decoding of equal-length prompts."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.device = device
        if importlib.util.find_spec("transformers"):
            import transformers
            self.name = f"transformers {transformers.__version__}"
            load = transformers.AutoModelForCausalLM.from_pretrained
            try:
                self.hf = load(model_dir, dtype=dtype)
            except TypeError:                                         # transformers < 4.56 spells it torch_dtype
                self.hf = load(model_dir, torch_dtype=dtype)
            self.hf = self.hf.to(device).eval()
        else:
            self.name, self.hf = "DenseLlama (plain torch; transformers is not installed here)", None
            self.dense = DenseLlama(model_dir, dtype, device)

    @torch.inference_mode()
    def last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """[len(seqs), V] float32: each prompt's logits at its last token, right-padded batch."""
        n, longest = len(seqs), max(len(s) for s in seqs)
        ids = torch.zeros(n, longest, dtype=torch.long, device=self.device)
        keep = torch.zeros(n, longest, dtype=torch.bool, device=self.device)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s, device=self.device)
            keep[r, : len(s)] = True
        last = torch.tensor([len(s) - 1 for s in seqs], device=self.device)
        if self.hf is not None:
            logits = self.hf(input_ids=ids, attention_mask=keep.long()).logits
        else:
            pos = torch.arange(longest, device=self.device).expand(n, -1)
            causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
            logits = self.dense.forward(ids, pos, mask=causal[None, None] & keep[:, None, None, :])
        return logits[torch.arange(n, device=self.device), last].float()

    @torch.inference_mode()
    def greedy(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        ids = torch.tensor(prompts, device=self.device)
        if self.hf is not None:
            out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, pad_token_id=0)
            return out[:, ids.shape[1]:].tolist()
        cache: list = []
        b, t = ids.shape
        logits = self.dense.forward(ids, torch.arange(t, device=self.device).expand(b, -1), cache)[:, -1]
        out = []
        for step in range(new):
            nxt = logits.argmax(-1)
            out.append(nxt)
            if step + 1 < new:
                pos = torch.full((b, 1), t + step, device=self.device)
                logits = self.dense.forward(nxt[:, None], pos, cache)[:, -1]
        return torch.stack(out, 1).tolist()


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def ours_scores(model: Any, prompts: list[list[int]], page_size: int, mode: str, **gen_kw: Any) -> torch.Tensor:
    from evalrun.engine import DynamicGenerator, DynamicJob, PagedCache
    cache = PagedCache(model, max_tokens=65536, page_size=page_size, mode=mode)
    gen = DynamicGenerator(model, cache, **gen_kw)
    gen.enqueue([DynamicJob(p, max_new_tokens=1, return_logits=True, identifier=i) for i, p in enumerate(prompts)])
    out = [None] * len(prompts)
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r["eos"]:
                out[r["identifier"]] = r["logits"][-1].float()
    return torch.stack(out)


def ours_greedy(model: Any, prompts: list[list[int]], new: int, page_size: int, mode: str) -> list[list[int]]:
    from evalrun.engine import DynamicGenerator, DynamicJob, PagedCache
    cache = PagedCache(model, max_tokens=65536, page_size=page_size, mode=mode)
    gen = DynamicGenerator(model, cache)
    gen.enqueue([DynamicJob(p, max_new_tokens=new, identifier=i) for i, p in enumerate(prompts)])
    out: list[list[int]] = [[] for _ in prompts]
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            out[r["identifier"]] += r["token_ids"]
    return out


def workloads(vocab: int, dry: bool, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    groups, per, prefix, question = (2, 3, 40, 9) if dry else (4, 40, 600, 110)
    mmlu = []
    for _ in range(groups):
        pre = torch.randint(3, vocab, (prefix,), generator=g).tolist()
        mmlu += [pre + torch.randint(3, vocab, (question,), generator=g).tolist() for _ in range(per)]
    rows, plen = (3, 12) if dry else (32, 128)
    decode = [torch.randint(3, vocab, (plen,), generator=g).tolist() for _ in range(rows)]
    return mmlu, decode


def agreement(ours: torch.Tensor, base: torch.Tensor) -> dict:
    lo, lb = torch.log_softmax(ours, -1), torch.log_softmax(base.to(ours.device), -1)
    top = lb.argmax(-1, keepdim=True)
    return {"same_argmax": int((ours.argmax(-1) == base.to(ours.device).argmax(-1)).sum()), "of": ours.shape[0],
            "max_abs_dlogprob_at_baseline_argmax": float((lo.gather(-1, top) - lb.gather(-1, top)).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--shape", choices=["1b", "8b"], default="1b")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dry-run", action="store_true", help="a tiny float32 model on the CPU")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from evalrun.engine import Model
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype, mode, page = (torch.float32, "fp32", 16) if dry else (torch.bfloat16, "bf16", 256)
    shape = SHAPES["tiny" if dry else args.shape]
    new = 5 if dry else args.new_tokens
    result: dict = {"shape": shape, "dtype": str(dtype), "device": torch.cuda.get_device_name() if not dry else "cpu"}
    path = args.out / "gpu_engine.json"

    def save(key: str, value: Any) -> None:
        result[key] = value
        path.write_text(json.dumps(result, indent=1))
        print(key, json.dumps(value), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        model_dir = make_model_dir(Path(tmp) / "model", shape, dtype, device)
        save("model_written_s", round(time.time() - t0, 1))
        mmlu, decode = workloads(shape["vocab_size"], dry)
        base = Baseline(model_dir, dtype, device)
        result["baseline"] = base.name
        order = sorted(range(len(mmlu)), key=lambda i: len(mmlu[i]))
        base_logits = torch.empty(len(mmlu), shape["vocab_size"])

        def base_mmlu() -> None:
            for i in range(0, len(order), 8):
                rows = order[i: i + 8]
                base_logits[rows] = base.last_logits([mmlu[r] for r in rows]).cpu()

        base_mmlu()                                                   # warm-up (cuBLAS, allocator)
        sec, _ = timed(base_mmlu, device)
        save("mmlu_baseline_s", round(sec, 3))
        sec, base_tokens = timed(lambda: base.greedy(decode, new), device)
        save("decode_baseline_s", round(sec, 3))
        base = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for det in (False, True):
            name = "deterministic" if det else "default"
            model = Model.load(model_dir, dtype=str(dtype).removeprefix("torch."), device=device.type,
                               deterministic=det)
            ours_scores(model, mmlu[:2], page, mode)                  # warm-up: Triton compiles
            sec, logits = timed(lambda: ours_scores(model, mmlu, page, mode), device)
            save(f"mmlu_ours_{name}", {"s": round(sec, 3), "vs_baseline": round(result["mmlu_baseline_s"] / sec, 2),
                                       **agreement(logits.cpu(), base_logits)})
            for graphs in ([True, False] if not dry else [False]):
                model.cuda_graphs = graphs
                ours_greedy(model, decode[:2], 3, page, mode)         # warm-up: compiles, captures buckets 1-2
                sec, tokens = timed(lambda: ours_greedy(model, decode, new, page, mode), device)
                same = sum(a == b for a, b in zip(tokens, base_tokens))
                save(f"decode_ours_{name}_{'graphs' if graphs else 'eager'}",
                     {"s": round(sec, 3), "new_tok_per_s": round(len(decode) * new / sec, 1),
                      "vs_baseline": round(result["decode_baseline_s"] / sec, 2),
                      "prompts_token_identical_to_baseline": f"{same}/{len(decode)}"})
            if det:                                                   # a job alone vs among all: bitwise
                alone = ours_scores(model, mmlu[:1], page, mode, max_batch_size=1)
                save("deterministic_alone_equals_batched", bool(torch.equal(alone[0].cpu(), logits[0].cpu())))
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        decode_kind = "eager" if dry else "graphs"
        save("deterministic_cost_mmlu", round(result["mmlu_ours_deterministic"]["s"] / result["mmlu_ours_default"]["s"] - 1, 3))
        save("deterministic_cost_decode", round(result[f"decode_ours_deterministic_{decode_kind}"]["s"]
                                                / result[f"decode_ours_default_{decode_kind}"]["s"] - 1, 3))

if __name__ == "__main__":
    main()
