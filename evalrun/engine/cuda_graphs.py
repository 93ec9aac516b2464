"""Decode steps replayed as CUDA graphs (issue 16), the way vLLM and SGLang cut a small model's
per-step launch cost: a pure decode batch of B rows runs the forward captured for the smallest
bucket >= B, after its inputs are copied into that bucket's static buffers. Batches of single
tokens only (decode steps, and speculative verify steps, whose draft rows are one-token sequences
too); prefill and mixed batches run eagerly, and so does every step over a cache whose kernel plan
is not graph-safe (`KernelPlan.cuda_graphs`, kernels/backend.py: off for windowed formats, ops the
Triton kernels do not take, and the flash-attn backend, whose split heuristic reads the lengths on
the host).

    buckets       1, 2, 4, then every multiple of 8 up to MAX_ROWS, and no more rows than keep the
                  decode kernel's split partials under SPLIT_BUDGET bytes
    static input  input_ids [Bb] int64, positions [Bb] int64, slot_mapping [Bb] int64,
                  page_table [Bb, max_pages] int32, seq_lens_k [Bb] int32, cu_seqlens_k [Bb + 1] int32
                  (cu_seqlens_q is arange(Bb + 1); max_seqlen_k is the longest context the cache
                  can hold, so the decode kernel's fixed splits cover every length: the splits a
                  row does not reach weigh exactly 0 in the merge, as in an eager batch)
    padding rows  token 0 at position 0, slot -1 (the Triton K/V writes store nothing for it),
                  one position read from the null page, which every padding row leaves untouched
    output        logits [Bb, V] float32, the first B rows copied out after the replay

A row's logits equal the eager forward's when every op of the step is batch-invariant
(deterministic mode: Triton linears and RMSNorm; Triton attention always), else they differ from
it as two eager batches of other sizes would (cuBLAS picks other kernels for other row counts).

`capture` is how a bucket is recorded: `cuda_capture` on a GPU; tests on a CPU pass one that
records nothing and replays by calling the step again on the same static buffers, which checks the
buffers, the padding and the metadata without a GPU (tests/test_triton_engine.py).
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from evalrun.kernels.attention import AttentionMetadata
from evalrun.kernels.cuda.triton_attention import SPLIT_LEN

from .cache import PagedCache
from .config import ModelConfig

log = logging.getLogger(__name__)


class ForwardBatch(Protocol):
    """engine/model.py's ForwardBatch, as the graphs read it (a static batch is a copy of the first
    real one with its tensors replaced)."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor


class Model(Protocol):
    """What the graphs need of engine/model.py's Model."""
    config: ModelConfig
    device: torch.device
    max_seq_len: int

    def eager_forward(self, batch: Any, cache: PagedCache) -> torch.Tensor: ...

MAX_ROWS = 256
SPLIT_BUDGET = 256 * 2**20        # bytes of float32 split partials ([rows, Hq, splits, D]) a bucket may hold
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def buckets(max_rows: int = MAX_ROWS) -> list[int]:
    return [b for b in (1, 2, 4) if b <= max_rows] + list(range(8, max_rows + 1, 8))


def cuda_capture(step: Callable[[], torch.Tensor], pool: Any = None,
                 device: Optional[torch.device] = None) -> tuple[Callable[[], None], torch.Tensor]:
    """Run `step` twice on a side stream (Triton compiles, cuBLAS sets up), then record it into a
    CUDA graph on `device`; returns (replay, the graph's output tensor)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()

    def replay() -> None:
        with torch.cuda.device(device):
            graph.replay()

    return replay, out


def eager_capture(step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for tests without a GPU: the 'graph' is the step itself, rerun on the static
    buffers at each replay, its output copied into one fixed tensor as a graph's would be."""
    out = step()

    def replay() -> None:
        out.copy_(step())

    return replay, out


@dataclass
class _Bucket:
    batch: ForwardBatch                     # the static inputs
    rows: int = 0                             # real rows of the last batch loaded (the rest are padding)
    replay: Callable[[], None] = field(default=lambda: None)
    logits: Optional[torch.Tensor] = None     # [Bb, V], written by each replay


class DecodeGraphs:
    """The captured decode steps of one model over one cache. Both are held weakly: the model
    keeps one DecodeGraphs per cache in a WeakKeyDictionary, which a strong reference to the cache
    would pin, and one to the model would make a cycle that only the cyclic GC frees."""

    def __init__(self, model: Model, cache: PagedCache, capture: Optional[Capture] = None,
                 max_rows: int = MAX_ROWS):
        self._model, self._cache = weakref.ref(model), weakref.ref(cache)
        self.capture = capture or self._cuda_capture
        self.device = model.device
        self.null_page, self.page_size = cache.null_page, cache.page_size
        self.max_len = min(model.max_seq_len, cache.max_tokens)
        self.max_pages = -(-self.max_len // cache.page_size)
        cfg = model.config
        per_row = cfg.num_heads * -(-self.max_len // SPLIT_LEN) * cfg.head_dim * 4
        self.sizes = buckets(max(1, min(max_rows, SPLIT_BUDGET // per_row)))
        self.pages = _page_ptrs(cache)
        self._buckets: dict[int, Optional[_Bucket]] = {}     # None: its capture failed, it runs eagerly
        self._pool: Any = None

    def pages_match(self, cache: PagedCache) -> bool:
        """The cache still has the page tensors the graphs were recorded on (their addresses are in
        the graphs)."""
        return _page_ptrs(cache) == self.pages

    def applies(self, batch: ForwardBatch) -> bool:
        """A batch of single-token rows, each its own sequence, every row's logits wanted."""
        attn, t = batch.attn, batch.input_ids.shape[0]
        return (0 < t <= self.sizes[-1] and attn.num_decode == t and not attn.prefill
                and batch.logits_indices.shape[0] == t and attn.page_table.shape[1] <= self.max_pages
                and attn.max_seqlen_k <= self.max_len)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's logits [B, V] float32 through the bucket's graph (captured on first use; a
        bucket whose capture fails runs eagerly from then on, with a warning).
        NOTE: the caller checked `applies`; logits_indices of a decode batch are its rows in order."""
        t = batch.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= t)
        if size not in self._buckets:
            self._buckets[size] = self._record(size, batch)
        bucket = self._buckets[size]
        if bucket is None:
            return self._model().eager_forward(batch, self._cache())
        self._load(bucket, batch, t)
        bucket.batch.attn.kernel_args.clear()          # nothing derived from an earlier batch's metadata
        bucket.replay()
        return bucket.logits[:t].clone()

    def _record(self, size: int, template: ForwardBatch) -> Optional[_Bucket]:
        bucket = _Bucket(self._static_batch(size, template))
        model, cache = self._model, self._cache
        try:
            bucket.replay, bucket.logits = self.capture(lambda: model().eager_forward(bucket.batch, cache()))
        except (RuntimeError, MemoryError) as e:       # e.g. out of memory for the graph's pool
            log.warning("CUDA graph of %d decode rows not captured (%s): those steps run eagerly", size, e)
            return None
        return bucket

    def _cuda_capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()      # one memory pool for every bucket
        return cuda_capture(step, self._pool, self.device)

    def _static_batch(self, size: int, template: ForwardBatch) -> ForwardBatch:
        """All rows padding (they write nothing), so capturing changes no page; a batch of the
        template's type."""
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        attn = AttentionMetadata(
            cu_seqlens_q=torch.arange(size + 1, **i32), cu_seqlens_k=torch.arange(size + 1, **i32),
            seq_lens_k=torch.ones(size, **i32), max_seqlen_q=1, max_seqlen_k=self.max_len,
            page_table=torch.full((size, self.max_pages), self.null_page, **i32), page_size=self.page_size,
            num_decode=size, decode_slots=None, decode_mask=None, prefill=[], null_page=self.null_page)
        i64 = dict(dtype=torch.long, device=dev)
        return dataclasses.replace(template, input_ids=torch.zeros(size, **i64), positions=torch.zeros(size, **i64),
                            slot_mapping=torch.full((size,), -1, **i64), attn=attn,
                            logits_indices=torch.arange(size, **i64))

    def _load(self, bucket: _Bucket, batch: ForwardBatch, t: int) -> None:
        """batch's t rows into the bucket's static buffers; rows the previous batch used beyond t
        back to padding (rows beyond it are padding already)."""
        static, s, a = bucket.batch, bucket.batch.attn, batch.attn
        static.input_ids[:t].copy_(batch.input_ids)
        static.positions[:t].copy_(batch.positions)
        static.slot_mapping[:t].copy_(batch.slot_mapping)
        s.seq_lens_k[:t].copy_(a.seq_lens_k)
        s.cu_seqlens_k[: t + 1].copy_(a.cu_seqlens_k)
        s.page_table[:t, : a.page_table.shape[1]].copy_(a.page_table)
        s.page_table[:t, a.page_table.shape[1]:].fill_(self.null_page)
        if bucket.rows > t:
            static.input_ids[t: bucket.rows].zero_()
            static.positions[t: bucket.rows].zero_()
            static.slot_mapping[t: bucket.rows].fill_(-1)
            s.seq_lens_k[t: bucket.rows].fill_(1)
            s.page_table[t: bucket.rows].fill_(self.null_page)
        # padding rows hold one key each: cu_seqlens_k continues from the real rows' total
        torch.add(s.cu_seqlens_q[1: s.cu_seqlens_q.shape[0] - t], s.cu_seqlens_k[t], out=s.cu_seqlens_k[t + 1:])
        bucket.rows = t

def _page_ptrs(cache: PagedCache) -> tuple[int, ...]:
    return tuple(t.data_ptr() for layer in cache.layers for t in layer.tensors())
