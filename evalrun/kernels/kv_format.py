"""How a paged KV cache stores K and V: `KVFormat` (chosen once, when the cache is built)
and `LayerKV` (one layer's storage tensors, the argument every cache kernel takes).

Unquantized formats keep float vectors:
    k, v        [P + 1, S, Hkv, D]            float32 / bfloat16 / float16
Quantized formats (the ExLlamaV2 scheme) keep codes plus one scale per group of G values
along the head dimension:
    k, v        [P + 1, S, Hkv, D * bits / 8]  uint8 codes (bits 8: one per byte; bits 4: two)
    k_scale,    [P + 1, S, Hkv, D / G]         float16, one per group
    v_scale
Codes are symmetric round-to-nearest, stored with an offset (8-bit: c + 128; 4-bit: c + 8,
byte j of a group holding element j in its low nibble and element j + G/2 in its high
one, so a kernel unpacks a group as two contiguous halves). With `rotate`, each group is
multiplied by the orthonormal G-point Walsh-Hadamard matrix before quantizing, which
spreads outliers across the group; attention then rotates the query the same way (q.k is
unchanged) and rotates the weighted sum of V back (the matrix is its own inverse).

P pages of S slots plus a last "null page" (zeros, zero scales) that padded reads use.

Recent-token window (`window` = W > 0, quantized formats): the keys and values of the
query's own block of W positions (block b = positions [bW, (b+1)W)) are attended exactly,
from a small per-job store, and only the blocks before it through the codes. KIVI and
transformers' QuantizedCache keep such a residual of recent tokens; the block alignment
makes every token's K/V a function of the tokens before it alone, so dedup, prompt caching
and chunked prefill stay exact (a reused prefix ends on a block boundary). The store:
    wk, wv      [J, W, Hkv, D]   `window_dtype`, one row block per running job
                                 (J = window slots; row r holds position bW + r)
The pages still hold the codes of every token: the window is an overlay, never a copy
that outlives the job.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from .cpu import huge_pages

DEFAULT_WINDOW = 128    # see benchmarks/bench_cache_modes.py for what it buys
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class KVFormat:
    name: str
    k_bits: Optional[int] = None        # None: K stored as `dtype` floats; 8 or 4: codes + scales
    v_bits: Optional[int] = None
    dtype: torch.dtype = torch.float32  # storage of unquantized K/V
    group_size: int = 32
    rotate: bool = False
    scale_dtype: torch.dtype = torch.float16
    window: int = 0                     # recent-token block attended exactly (0: none)
    window_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if (self.k_bits is None) != (self.v_bits is None):
            raise ValueError("a KV format quantizes both K and V or neither")
        for bits in (self.k_bits, self.v_bits):
            if bits not in (None, 4, 8):
                raise ValueError(f"code widths are 4 or 8 bits, got {bits}")
        if self.group_size < 2 or self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size must be a power of two >= 2, got {self.group_size}")
        if not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"the recent-token window must be an integer >= 0, got {self.window!r}")
        if self.window and not self.quantized:
            raise ValueError("a recent-token window is for quantized formats (unquantized ones are exact)")

    @property
    def quantized(self) -> bool:
        return self.k_bits is not None

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError when this format cannot store head vectors of head_dim values."""
        if self.quantized and head_dim % self.group_size:
            raise ValueError(f"cache mode {self.name} quantizes groups of {self.group_size} values, "
                             f"but the model's head dimension {head_dim} is not divisible by "
                             f"{self.group_size}; use an unquantized mode (fp32, bf16, fp16)")

    def check_page_size(self, page_size: int) -> None:
        """Raises ValueError when the window's blocks do not tile a page (reuse of a page
        boundary must be a block boundary)."""
        if self.window and page_size % self.window:
            raise ValueError(f"cache mode {self.name} attends the last {self.window} tokens exactly, in "
                             f"blocks that must tile a page, but page size {page_size} is not a multiple "
                             f"of {self.window}; pick a page size that is, or another window")

    def window_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one job's window store over all layers (K and V)."""
        if not self.window:
            return 0
        per = self.window * num_kv_heads * head_dim * torch.empty((), dtype=self.window_dtype).element_size()
        return 2 * per * num_layers

    def slot_shapes(self, num_kv_heads: int, head_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per storage tensor of one layer: the shape of one slot and its dtype."""
        self.check_head_dim(head_dim)
        if not self.quantized:
            return {"k": ((num_kv_heads, head_dim), self.dtype), "v": ((num_kv_heads, head_dim), self.dtype)}
        groups = (num_kv_heads, head_dim // self.group_size)
        return {"k": ((num_kv_heads, head_dim * self.k_bits // 8), torch.uint8),
                "v": ((num_kv_heads, head_dim * self.v_bits // 8), torch.uint8),
                "k_scale": (groups, self.scale_dtype), "v_scale": (groups, self.scale_dtype)}

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one cached token takes over all layers, scales included (what `allocate` makes)."""
        per_layer = 0
        for shape, dtype in self.slot_shapes(num_kv_heads, head_dim).values():
            per_layer += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return per_layer * num_layers

    def describe(self) -> str:
        if not self.quantized:
            return f"{self.name}: {str(self.dtype).removeprefix('torch.')} K and V"
        rot = f", {self.group_size}-point Hadamard rotation" if self.rotate else ", no rotation"
        win = (f", the current block of {self.window} tokens exact ({str(self.window_dtype).removeprefix('torch.')})"
               if self.window else ", no exact window")
        return (f"{self.name}: {self.k_bits}-bit K, {self.v_bits}-bit V, one fp16 scale per "
                f"{self.group_size} values{rot}{win}")


KV_FORMATS: dict[str, KVFormat] = {
    **{name: KVFormat(name, dtype=dt) for name, dt in FLOAT_DTYPES.items()},
    "q8": KVFormat("q8", k_bits=8, v_bits=8, rotate=True, window=DEFAULT_WINDOW),
    # q6: 8-bit K, 4-bit V (as ExLlamaV2's Q6)
    "q6": KVFormat("q6", k_bits=8, v_bits=4, rotate=True, window=DEFAULT_WINDOW),
    "q4": KVFormat("q4", k_bits=4, v_bits=4, rotate=True, window=DEFAULT_WINDOW),
}


def kv_format(mode: "str | KVFormat", window: Optional[int] = None) -> KVFormat:
    """The format of a cache mode name (a KVFormat passes through); `window` overrides the
    recent-token window of a quantized format (0: none, the plain ExLlamaV2 scheme)."""
    if isinstance(mode, KVFormat):
        fmt = mode
    elif mode not in KV_FORMATS:
        raise ValueError(f"cache mode must be one of {', '.join(KV_FORMATS)}, got {mode!r}")
    else:
        fmt = KV_FORMATS[mode]
    if window is None or window == fmt.window:
        return fmt
    if not fmt.quantized:
        raise ValueError(f"cache mode {fmt.name} is exact: a recent-token window is for q8, q6 and q4")
    return dataclasses.replace(fmt, window=window)


@dataclass
class LayerKV:
    """One layer's cache storage in `fmt` (scales are None for unquantized formats)."""
    fmt: KVFormat
    k: torch.Tensor
    v: torch.Tensor
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    wk: Optional[torch.Tensor] = None   # [J, W, Hkv, D] the recent-token window (fmt.window > 0)
    wv: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, fmt: KVFormat, num_pages_with_null: int, page_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, window_slots: int = 0) -> "LayerKV":
        """Every storage tensor, its last page (the null page) zeros so padded reads see zero K/V;
        with a window, `window_slots` job blocks of it. The real pages are left unwritten, on 2 MiB
        pages where the OS allows (evalrun/kernels/cpu/huge_pages.py): no kernel reads a slot before its token
        is written (the tests poison them with NaN to check), and zero-filling a 65536-token
        float32 cache of SmolLM2 took ~7 s of every process start (a Ray replica's included)."""
        tensors = {name: huge_pages.empty((num_pages_with_null, page_size, *shape), dtype, device)
                   for name, (shape, dtype) in fmt.slot_shapes(num_kv_heads, head_dim).items()}
        for t in tensors.values():
            t[num_pages_with_null - 1].zero_()
        if fmt.window:
            fmt.check_page_size(page_size)
            if window_slots < 1:
                raise ValueError(f"cache mode {fmt.name} keeps a recent-token window per running job: "
                                 "it needs window_slots >= 1")
            for name in ("wk", "wv"):
                tensors[name] = torch.zeros((window_slots, fmt.window, num_kv_heads, head_dim),
                                            dtype=fmt.window_dtype, device=device)
        return cls(fmt, **tensors)

    def standard_layout(self) -> bool:
        """Whether the tensors are laid out as `allocate` makes them: each the format's slot shape
        and dtype over the same [pages, page_size], contiguous, on one device (the window store too)."""
        try:
            want = self.fmt.slot_shapes(self.k.shape[2], self.head_dim) if self.k.dim() == 4 else None
        except (ValueError, IndexError):
            return False
        got = {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale}
        if want is None or any(got[n] is not None for n in got if n not in want):
            return False
        lead = tuple(self.k.shape[:2])
        if any(got[n] is None or tuple(got[n].shape) != (*lead, *shape) or got[n].dtype != dt
               for n, (shape, dt) in want.items()):
            return False
        if self.fmt.window and not all(t is not None and tuple(t.shape[1:]) == (self.fmt.window, *self.k.shape[2:3],
                                                                                  self.head_dim)
                                       and t.dtype == self.fmt.window_dtype for t in (self.wk, self.wv)):
            return False
        tensors = self.tensors() + self.window_tensors()
        return len({t.device for t in tensors}) == 1 and all(t.is_contiguous() for t in tensors)

    def tensors(self) -> list[torch.Tensor]:
        """Every page storage tensor; all are indexed [page, slot, ...] (the window is not)."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def window_tensors(self) -> list[torch.Tensor]:
        """The window store [J, W, Hkv, D] (K, V), or nothing."""
        return [t for t in (self.wk, self.wv) if t is not None]

    def data_tensors(self) -> list[torch.Tensor]:
        """The tensors whose NaN poisons a slot: the floats, or the scales of codes."""
        return [self.k_scale, self.v_scale] if self.fmt.quantized else [self.k, self.v]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_scale.shape[3] * self.fmt.group_size if self.fmt.quantized else self.k.shape[3]

    @property
    def window_slots(self) -> int:
        return 0 if self.wk is None else self.wk.shape[0]

    def memory_bytes(self) -> int:
        """Pages and window store."""
        return sum(t.numel() * t.element_size() for t in self.tensors() + self.window_tensors())

    def page_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
