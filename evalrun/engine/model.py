"""Decoder-only transformers over a paged KV cache: the Llama family (Llama with its biases, Mistral,
Qwen2, Qwen3), Gemma 2 / 3 (their norms around each sublayer, GeGLU, soft-capping) and OLMo 2 (norms
after each sublayer only); sliding windows.

One forward runs a packed batch: the new tokens of many sequences (prefill
chunks and single decode tokens) as one [T, hidden] matrix per layer, no padding.
Only the positions listed in `ForwardBatch.logits_indices` go through the final
norm and the LM head, in float32.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from evalrun.kernels.attention import AttentionMetadata
from evalrun.kernels.backend import KernelPlan, PlanKey, TorchKernels, choose_kernels
from evalrun.kernels.cpu.decode_step import DecodeStep, LayerParts
from evalrun.kernels.kv_format import KVFormat
from evalrun.kernels.linear import Linear, invariant_unavailable_reason, linear, linear_backend
from evalrun.kernels.linear import make_linear as _make_linear

from .auto import choose_dtype, host_facts
from .cache import PagedCache, resolve_format
from .config import ModelConfig
from .cuda_graphs import DecodeGraphs
from .gguf import GGUFWeights, is_gguf, load_gguf
from .rope import rope_inv_freq, rope_table
from .weights import WeightReader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_ROWS = 4096       # rope table rows made at load (more as longer sequences come: Model.rope_rows)


def plan_key(config: ModelConfig, fmt: KVFormat, page_size: int, device: "str | torch.device",
             dtype: torch.dtype, deterministic: bool = False) -> PlanKey:
    """What a model's kernel plan over one cache is resolved for (Model.kernel_plan, the manifest)."""
    return PlanKey(torch.device(device).type, dtype, fmt, page_size, config.num_heads, config.num_kv_heads,
                   config.head_dim, config.intermediate_size, deterministic, variants=config.windowed or bool(config.attn_softcap),
                   act=config.hidden_act)


def kernel_backends(device: str, dtype: str, cache_mode: str, deterministic: bool = False,
                    config: Optional[ModelConfig] = None, page_size: int = 256,
                    window: Optional[int] = None) -> dict[str, str]:
    """The kernel plan a model of `config` with these settings runs (recorded in run manifests):
    the backend, the linears' kernel (layers and the float32 LM head) and the plan's names, by the
    same resolution Model.kernel_plan makes when the cache is made."""
    fmt = resolve_format(cache_mode, page_size, window)
    if config is None:           # a nominal Llama head (8 heads of 64, no GQA) where no config is given
        key = PlanKey(torch.device(device).type, DTYPES[dtype], fmt, page_size, 8, 8, 64, 0, deterministic)
    else:
        key = plan_key(config, fmt, page_size, device, DTYPES[dtype], deterministic)
    plan = choose_kernels(device, deterministic).plan(key)
    return {"backend": plan.backend, "linear": key.linear,
            "lm_head": linear_backend(device, head_dtype(device, key.dtype, deterministic), deterministic),
            **plan.describe()}


def head_dtype(device: "str | torch.device", dtype: torch.dtype, deterministic: bool = False) -> torch.dtype:
    """The LM head's weight dtype: float32 (it reads float32 rows), except on the bf16 GEMM, where a
    bf16 model's head is bf16 like its layers (half the bytes each decode step streams)."""
    return dtype if linear_backend(device, dtype, deterministic) == "native-bf16" else torch.float32


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor   # [N] int64 rows of the packed batch whose logits are needed


@dataclass
class LayerWeights:
    input_norm: Optional[torch.Tensor]   # [H]; None: no norm before the attention (OLMo 2)
    wqkv: Linear                   # [(Hq + 2 Hkv) * D, H], bias [(Hq + 2 Hkv) * D] (Qwen2, Llama attention_bias)
    wo: Linear                     # [H, Hq * D], bias [H] (Llama attention_bias)
    post_norm: Optional[torch.Tensor]    # [H] the MLP input's norm; None: none (OLMo 2)
    w_gate_up: Linear              # [2 I, H], bias [2 I] (Llama mlp_bias)
    w_down: Linear                 # [H, I], bias [H] (Llama mlp_bias)
    q_norm: Optional[torch.Tensor] = None    # [D] RMSNorm of each q head before rope (Qwen3, Gemma 3), or
                                             # [Hq * D] of the whole q projection (OLMo 2)
    k_norm: Optional[torch.Tensor] = None    # [D] / [Hkv * D] the same for k
    sliding_window: int = 0        # the layer's sliding window (0: full attention)
    softcap: float = 0.0           # the layer's attention soft-capping (0: none)
    attn_out_norm: Optional[torch.Tensor] = None   # [H] norm of the attention's output before the residual add (Gemma)
    mlp_out_norm: Optional[torch.Tensor] = None    # [H] ... of the MLP's output (Gemma)
    rope: int = 0                  # the rope table it reads (ModelConfig.layer_rope)


class Model:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: Linear, dtype: torch.dtype, device: torch.device,
                 kernels: Optional[TorchKernels] = None, deterministic: bool = False, cuda_graphs: bool = False):
        self.config = config
        self.deterministic = deterministic     # batch-invariant linears (evalrun/kernels/linear.py), any dtype
        self.kernels = kernels or choose_kernels(device, deterministic)   # resolves each cache's KernelPlan
        self.dtype = dtype
        self.device = device
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm           # float32: the head runs in float32
        self.lm_head = lm_head                 # [V, H] head_dtype(): float32, or bf16 on the bf16 GEMM
        # one (cos, sin) table [rows, D] per rope of the config: `rope`, then Gemma 3's local one; made
        # for the first ROPE_ROWS positions and grown as longer sequences come (rope_rows), so a config's
        # context (up to 2**24 positions) costs nothing until a sequence reaches it
        self._rope_freqs = [(rope_inv_freq(r, config.rope_dim), r.attention_factor)
                            for r in (config.rope, config.local_rope) if r is not None]
        self.rope_tables = self._make_rope_tables(min(config.max_seq_len, ROPE_ROWS))
        # NOTE: on CUDA, tables replaced by larger ones are kept: a captured decode graph reads the
        # table it was recorded with (the rows it reads are the same in the larger one)
        self._replaced_rope_tables: list = []
        self._steps: "weakref.WeakKeyDictionary[PagedCache, DecodeStep]" = weakref.WeakKeyDictionary()
        # decode steps as CUDA graphs (evalrun/engine/cuda_graphs.py), per cache; graph_capture: how a
        # bucket is recorded (None: a real CUDA graph; tests set a stand-in)
        self.cuda_graphs = cuda_graphs
        self.graph_capture = None
        self._graphs: "weakref.WeakKeyDictionary[PagedCache, Optional[DecodeGraphs]]" = weakref.WeakKeyDictionary()

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str = "bfloat16", device: str = "cpu",
             kernels: Optional[TorchKernels] = None, deterministic: bool = False,
             cuda_graphs: bool = True) -> "Model":
        """Load a Hugging Face model directory (config.json + safetensors, sharded or not), or a
        llama.cpp .gguf file (its weights de-quantized once, here, to `dtype`: engine/gguf.py).
        dtype "auto": bfloat16 on CUDA or a CPU with native bf16, else float32 (evalrun/engine/auto.py).
        kernels: the backend that resolves each cache's KernelPlan (default: chosen for the device,
        kernels/backend.py choose_kernels).
        deterministic: batch-invariant linears in every dtype, so a row's logits do not depend on
        what else is in its batch (ValueError where they cannot run: kernels.linear).
        cuda_graphs: on CUDA with the Triton kernels, pure decode steps replay CUDA graphs
        (evalrun/engine/cuda_graphs.py); False runs every step eagerly."""
        if dtype == "auto":
            dtype = choose_dtype("auto", device, host_facts(probe=not device.startswith("cuda"))).value
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if deterministic:
            reason = invariant_unavailable_reason(device)
            if reason is not None:
                raise ValueError(f"deterministic mode: {reason}")
        model_dir = Path(model_dir)
        if is_gguf(model_dir):         # a llama.cpp file: config and weights from it (engine/gguf.py)
            config, reader = load_gguf(model_dir, DTYPES[dtype], torch.device(device))
        else:
            config = ModelConfig.load(model_dir)
            reader = WeightReader(model_dir, DTYPES[dtype], torch.device(device))
        model = _build(config, reader, DTYPES[dtype], torch.device(device), kernels, deterministic)
        if isinstance(reader, GGUFWeights):
            reader.check_all_read()
        model.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        return model

    def _make_rope_tables(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tuple(t.to(self.device) for t in rope_table(inv_freq, rows, scale))
                for inv_freq, scale in self._rope_freqs]

    def rope_rows(self, positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The rope tables (cos, sin) [rows, D], grown to cover positions 0 .. positions - 1 (doubling,
        at most max_seq_len rows). A row is the same in a table of any length (rope.rope_table)."""
        rows = self.rope_tables[0][0].shape[0]
        if positions > rows:
            rows = min(self.config.max_seq_len, max(positions, 2 * rows))
            if self.device.type == "cuda":
                self._replaced_rope_tables.append(self.rope_tables)
            self.rope_tables = self._make_rope_tables(rows)
        return self.rope_tables

    def kernel_plan(self, fmt: KVFormat, page_size: int) -> KernelPlan:
        """The kernels this model runs over a cache of `fmt` and `page_size` (resolved once per key;
        PagedCache keeps it as `cache.kernels`)."""
        return self.kernels.plan(plan_key(self.config, fmt, page_size, self.device, self.dtype, self.deterministic))

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: "PagedCache") -> torch.Tensor:
        """Returns float32 logits [N, vocab] for batch.logits_indices."""
        graphs = self._decode_graphs(cache) if self.cuda_graphs else None
        if graphs is not None and graphs.applies(batch):
            return graphs.run(batch)
        return self.eager_forward(batch, cache)

    def _decode_graphs(self, cache: "PagedCache") -> "Optional[DecodeGraphs]":
        """The CUDA graphs of decode steps over this cache (evalrun/engine/cuda_graphs.py), or None where
        they do not apply; rebuilt if the cache's pages were ever replaced."""
        graphs = self._graphs.get(cache, False)
        if graphs is False or (graphs is not None and not graphs.pages_match(cache)):
            graphs = None
            if cache.kernels.cuda_graphs:
                # the rope rows a graph may read, made before any capture (a capture must not allocate them)
                self.rope_rows(min(self.max_seq_len, cache.max_tokens))
                graphs = DecodeGraphs(self, cache, self.graph_capture)
            self._graphs[cache] = graphs
        return graphs

    @torch.inference_mode()
    def eager_forward(self, batch: ForwardBatch, cache: "PagedCache") -> torch.Tensor:
        """forward without CUDA graphs."""
        cfg, plan = self.config, cache.kernels
        x = F.embedding(batch.input_ids, self.embed)                      # [T, H]
        if cfg.embed_scale != 1.0:                                        # Gemma: times sqrt(H) in the weights' dtype
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        if plan.stream_dtype is not None:                                 # the plan's residual stream
            x = x.to(plan.stream_dtype)
        ropes = [tuple(t.index_select(0, batch.positions).to(x.dtype) for t in table)   # [T, D] each
                 for table in self.rope_rows(batch.attn.max_seqlen_k)]
        step = self._decode_step(cache)
        if step is not None and step.applies(batch.attn, x.shape[0]):
            x = step.run(x, ropes, batch.slot_mapping, batch.attn)            # every layer, one native call
        else:
            rows, last = batch.logits_indices, len(self.layers) - 1
            # the last layer's keys and values are needed at every position, but its output only
            # at the rows whose logits are wanted: there the attention output projection and the
            # MLP run on those rows alone. Every op after the attention is row-wise, so a row's
            # values are bitwise unchanged where the linears give a row the same bits at any row
            # count (the native float32 GEMM, deterministic mode), else equal up to rounding (as
            # they are anyway between batches). A prefill chunk saves most of one layer's FLOPs
            # (~1/30 of them for SmolLM2's 30 layers).
            prune = rows.shape[0] < x.shape[0]
            for i, layer in enumerate(self.layers):
                keep = rows if prune and i == last else None
                x = self._attention(i, layer, x, *ropes[layer.rope], batch, cache, keep)   # x + attention
                h = x if layer.post_norm is None else plan.input_norm(x, layer.post_norm, cfg.rms_norm_eps)
                act = plan.gate_up_gelu(h, layer.w_gate_up) if cfg.hidden_act == "gelu_tanh" else \
                    plan.gate_up_silu(h, layer.w_gate_up)
                x = self._add_output(x, act, layer.w_down, layer.mlp_out_norm, plan)
            if prune:
                return self._head(x, None, plan)
        return self._head(x, batch.logits_indices, plan)

    def _head(self, x: torch.Tensor, rows: Optional[torch.Tensor], plan: KernelPlan) -> torch.Tensor:
        """The final norm and the LM head at `rows` of x (None: every row): float32 logits [N, V]."""
        h = (x if rows is None else x.index_select(0, rows)).float()      # [N, H]
        h = plan.head_norm(h, self.final_norm, self.config.rms_norm_eps)
        logits = linear(h, self.lm_head)
        cap = self.config.final_softcap
        return torch.tanh(logits / cap).mul_(cap) if cap else logits

    def _add_output(self, x: torch.Tensor, h: torch.Tensor, w: Linear, out_norm: Optional[torch.Tensor],
                    plan: KernelPlan) -> torch.Tensor:
        """x + h @ w^T: the residual add fused into the projection, or (Gemma) x + norm(h @ w^T)."""
        if out_norm is None:
            return linear(h, w, residual=x, out_dtype=x.dtype)
        return x + plan.rms_norm(linear(h, w, out_dtype=x.dtype), out_norm, self.config.rms_norm_eps)

    def _decode_step(self, cache: "PagedCache") -> Optional[DecodeStep]:
        """The native decode step for this cache (kernels/cpu/decode_step.py), or None where its plan
        has none. Built once per cache and rebuilt if the cache's pages were ever replaced."""
        if not cache.kernels.decode_step:
            return None
        step = self._steps.get(cache)
        if step is not None and step.pages_match([cache.layer(i) for i in range(len(self.layers))]):
            return step
        cfg = self.config
        parts = [LayerParts(ly.input_norm, ly.post_norm, ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down, cache.layer(i),
                            ly.sliding_window, ly.softcap, ly.q_norm, ly.k_norm, ly.attn_out_norm, ly.mlp_out_norm,
                            ly.rope) for i, ly in enumerate(self.layers)]
        dims = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
        if not DecodeStep.supports(parts, self.dtype, self.device, *dims):
            raise ValueError("the kernel plan runs the native decode step, but this model's weights or this "
                             "cache's pages are not laid out as it reads them")
        step = self._steps[cache] = DecodeStep(parts, *dims, cfg.rms_norm_eps, cfg.scale, cfg.hidden_act,
                                               len(self.rope_tables), cfg.rope_dim)
        return step

    def _attention(self, i: int, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch: ForwardBatch, cache: "PagedCache",
                   keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x + self-attention(x) (the residual add fused into the output projection); with `keep`,
        only those rows of it (K/V are still written at every position)."""
        cfg = self.config
        t = x.shape[0]
        plan = cache.kernels
        h = x if layer.input_norm is None else plan.input_norm(x, layer.input_norm, cfg.rms_norm_eps)
        qkv = linear(h, layer.wqkv, out_dtype=x.dtype)
        if layer.q_norm is not None:
            qkv = self._qk_norm(qkv, layer, plan)
        kv = cache.layer(i)
        q, k, v = plan.rope_write_kv(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, kv, batch.slot_mapping)
        o = plan.attention(q, kv, batch.attn, cfg.scale, k, v, layer.sliding_window, layer.softcap)  # [T, Hq, D]
        o = o.reshape(t, cfg.num_heads * cfg.head_dim)
        if keep is not None:
            o, x = o.index_select(0, keep), x.index_select(0, keep)
        return self._add_output(x, o, layer.wo, layer.attn_out_norm, plan)

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights, plan: KernelPlan) -> torch.Tensor:
        """RMSNorm of every q head and every k head of qkv [T, (Hq + 2 Hkv) D] over its D values
        (Qwen3, Gemma 3), or of the whole q and k projections (OLMo 2), before rope; v is left as it is."""
        cfg = self.config
        t, d = qkv.shape[0], cfg.head_dim
        nq, nk = cfg.num_heads * d, cfg.num_kv_heads * d
        qw, kw = (d, d) if cfg.qk_norm == "head" else (nq, nk)
        q = plan.rms_norm(qkv[:, :nq].reshape(-1, qw), layer.q_norm, cfg.rms_norm_eps)
        k = plan.rms_norm(qkv[:, nq: nq + nk].reshape(-1, kw), layer.k_norm, cfg.rms_norm_eps)
        return torch.cat([q.view(t, nq), k.view(t, nk), qkv[:, nq + nk:]], dim=1)


def _build(cfg: ModelConfig, r: WeightReader, dtype: torch.dtype, device: torch.device,
           kernels: Optional[TorchKernels], deterministic: bool = False) -> Model:
    h, d = cfg.hidden_size, cfg.head_dim

    def make_linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Linear:
        return _make_linear(weight, bias, invariant=deterministic)

    q_rows, kv_rows, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size

    def norm(name: str, size: int, norm_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """An RMSNorm weight; Gemma's (1 + w) computed and kept in float32, as transformers multiplies
        it (every kernel's RMSNorm takes float32 weights and rounds its output once)."""
        if cfg.norm_offset:
            return 1.0 + r.get(name, (size,), dtype=torch.float32)
        return r.get(name, (size,), dtype=norm_dtype)

    def biases(prefix: str, names: tuple[str, ...], sizes: tuple[int, ...], present: bool) -> Optional[torch.Tensor]:
        """The named projections' biases, concatenated (None where the config has none)."""
        if not present:
            return None
        return torch.cat([r.get(f"{prefix}{n}.bias", (size,)) for n, size in zip(names, sizes)])

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.fused_proj:           # Phi-3: [q | k | v] and [gate | up] as stored
            wqkv = r.get(p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, h))
            gate_up = r.get(p + "mlp.gate_up_proj.weight", (2 * inter, h))
        else:
            wqkv = torch.cat([r.get(p + "self_attn.q_proj.weight", (q_rows, h)),
                              r.get(p + "self_attn.k_proj.weight", (kv_rows, h)),
                              r.get(p + "self_attn.v_proj.weight", (kv_rows, h))])
            gate_up = torch.cat([r.get(p + "mlp.gate_proj.weight", (inter, h)),
                                 r.get(p + "mlp.up_proj.weight", (inter, h))])
        bqkv = biases(p + "self_attn.", ("q_proj", "k_proj", "v_proj"), (q_rows, kv_rows, kv_rows), cfg.qkv_bias)
        whole = cfg.qk_norm == "proj"
        qk_norms = ((norm(p + "self_attn.q_norm.weight", q_rows if whole else d),
                     norm(p + "self_attn.k_norm.weight", kv_rows if whole else d)) if cfg.qk_norm else (None, None))
        # Gemma, OLMo 2: post_attention_layernorm is the attention output's norm; Gemma's
        # pre_feedforward_layernorm the MLP input's (Llama's post_attention_layernorm)
        pre, post = cfg.norm_layout in ("pre", "sandwich"), cfg.norm_layout in ("sandwich", "post")
        layers.append(LayerWeights(
            input_norm=norm(p + "input_layernorm.weight", h) if pre else None,
            wqkv=make_linear(wqkv, bqkv),
            wo=make_linear(r.get(p + "self_attn.o_proj.weight", (h, q_rows)),
                           biases(p + "self_attn.", ("o_proj",), (h,), cfg.o_bias)),
            post_norm=(norm(p + ("pre_feedforward_layernorm.weight" if post else "post_attention_layernorm.weight"), h)
                       if pre else None),
            w_gate_up=make_linear(gate_up, biases(p + "mlp.", ("gate_proj", "up_proj"), (inter, inter), cfg.mlp_bias)),
            w_down=make_linear(r.get(p + "mlp.down_proj.weight", (h, inter)),
                               biases(p + "mlp.", ("down_proj",), (h,), cfg.mlp_bias)),
            q_norm=qk_norms[0], k_norm=qk_norms[1], sliding_window=cfg.window(i), softcap=cfg.attn_softcap,
            attn_out_norm=norm(p + "post_attention_layernorm.weight", h) if post else None,
            mlp_out_norm=norm(p + "post_feedforward_layernorm.weight", h) if post else None,
            rope=cfg.layer_rope(i),
        ))
    embed = r.get("model.embed_tokens.weight", (cfg.vocab_size, h))
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    lm_head = r.get(head_name, (cfg.vocab_size, h), dtype=head_dtype(device, dtype, deterministic))
    final_norm = norm("model.norm.weight", h, torch.float32)
    return Model(cfg, embed, layers, final_norm, make_linear(lm_head), dtype, device, kernels, deterministic)
