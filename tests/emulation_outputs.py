"""The native kernels' outputs on fixed inputs, saved for tests/test_emulation_fidelity.py, which runs this
once natively and once under EVALRUN_NATIVE_EMULATE=avx512_bf16 and compares the two bitwise.

    python -m tests.emulation_outputs OUT.pt

Every kernel with AVX-512 code: the bf16 GEMM (rows as float32 and as bf16, the SiLU epilogue to float32
and to bf16), the float32 GEMM's 512-bit tiles (and its SiLU epilogue), the fused element-wise ops,
decode attention over every page kind at the shapes that hit each tile and tail, and prefill attention
over float and code pages. The first line it prints is the paths the build took, so a test can see
that both builds ran the AVX-512 code.
"""
from __future__ import annotations

import sys

import torch

from evalrun.kernels.cpu import fused, gemm, gemm_bf16, paged_decode, paged_prefill
from evalrun.kernels.cpu.host import cpu_flags
from evalrun.kernels.kv_format import KV_FORMATS
from evalrun.kernels.ref.attention import attend
from tests.test_native_kernels import _paged_case


def _gemms(out: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(1)
    for m, n, k in [(1, 960, 576), (2, 48, 40), (5, 17, 33), (32, 3072, 576), (65, 576, 1536), (300, 100, 130)]:
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
        x = torch.randn(m, k, generator=g) * 3
        panels = gemm_bf16.pack(w)
        out[f"bf16 gemm {m}x{n}x{k}"] = gemm_bf16.gemm(x, panels, n, out_dtype=torch.float32)
        out[f"bf16 gemm bf16 rows {m}x{n}x{k}"] = gemm_bf16.gemm(x.to(torch.bfloat16), panels, n, out_dtype=torch.float32)
        if n % 32 == 0 and gemm_bf16.silu_fusable(n // 2):
            out[f"bf16 silu {m}x{n}x{k}"] = gemm_bf16.gemm_silu(x, panels, n // 2)
            out[f"bf16 silu to bf16 {m}x{n}x{k}"] = gemm_bf16.gemm_silu(x, panels, n // 2, torch.bfloat16)
        wf = w.float()
        out[f"f32 gemm {m}x{n}x{k}"] = gemm.gemm(x, gemm.pack(wf), n)
        if n % 32 == 0 and gemm.silu_fusable(n // 2):
            silu = gemm.gemm_silu(x, gemm.pack(wf), n // 2)
            if silu is not None:
                out[f"f32 silu {m}x{n}x{k}"] = silu


def _fused(out: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(2)
    for rows, h in [(1, 576), (7, 13), (300, 1100)]:
        x, w = torch.randn(rows, h, generator=g) * 4, torch.randn(h, generator=g)
        out[f"rms_norm {rows}x{h}"] = fused.rms_norm_native(x, w, 1e-5)
        out[f"rms_norm to bf16 {rows}x{h}"] = fused.rms_norm_native(x, w, 1e-5, torch.bfloat16)
        gu = torch.randn(rows, 2 * h, generator=g) * 8
        out[f"silu_mul {rows}x{h}"] = fused.silu_mul_native(gu)
        out[f"gelu_tanh_mul {rows}x{h}"] = fused.gelu_tanh_mul_native(gu)
        logits = torch.randn(rows, 4 * h, generator=g)
        logits[0, 5] = float("nan")
        out[f"argmax {rows}x{4 * h}"], out[f"finite {rows}x{4 * h}"] = fused.argmax_finite_rows(logits)


def _attention(out: dict[str, torch.Tensor]) -> None:
    for mode, f in KV_FORMATS.items():
        for hq, hkv, d, page in [(9, 3, 64, 256), (5, 1, 48, 16), (8, 2, 128, 5), (12, 3, 112, 16)]:
            if f.quantized and d % f.group_size:
                continue
            lens = [1, 3, 15, 16, 17, 33, 130, 2 * page + 3]
            q, layer, meta = _paged_case(hq, hkv, d, page, lens, mode, seed=hq * d + page)
            out[f"decode {mode} {hq}/{hkv}x{d} page {page}"] = paged_decode.paged_decode_native(
                q, layer, meta.page_table, meta.seq_lens_k, d ** -0.5)
            if d % paged_prefill.LANES == 0 and not f.window:
                q, layer, meta = _paged_case(hq, hkv, d, page, [5, 40, 300, 17], mode, seed=hq + d + page,
                                             q_lens=[5, 3, 130, 1])
                out[f"prefill {mode} {hq}/{hkv}x{d} page {page}"] = attend(
                    q, layer, meta, d ** -0.5, prefill=paged_prefill.prefill_native)


def main(path: str) -> None:
    print(gemm.width(), gemm_bf16.path(), "avx512_bf16" in (cpu_flags() or ()), flush=True)
    out: dict[str, torch.Tensor] = {}
    _gemms(out)
    _fused(out)
    _attention(out)
    torch.save(out, path)


if __name__ == "__main__":
    main(sys.argv[1])
