"""The recent-token window of the quantized cache modes (evalrun/kernels/kv_format.py): each query
attends the keys of its own block of W positions exactly (fp16) and the older ones through
the codes. Checked against a masked reference written here from the quantize/rotate
reference ops alone, through several forwards (prefill chunks that start and end inside a
block, decode steps) for both kernel backends; then the engine rules that keep it exact
(reuse stops at a block boundary, one store block per running job) and the CLI."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy_jobs, logit_atol, random_prompts, run_jobs

from evalrun.engine import DynamicGenerator, Model, PagedCache
from evalrun.commands.cli import main
from evalrun.kernels.cpu import paged_decode
from evalrun.kernels.attention import build_metadata
from evalrun.kernels.backend import NativeCpuKernels, TorchKernels
from evalrun.kernels.kv_format import KV_FORMATS, KVFormat, LayerKV, kv_format
from evalrun.kernels.ref.kv_quant import dequantize, quantize, rotate

G = 32
FIXTURE = Path(__file__).resolve().parent / "data" / "mmlu"


def _through_codes(x: torch.Tensor, bits: int, fmt: KVFormat) -> torch.Tensor:
    """What attention sees of x read from the pages, back in x's domain."""
    codes, scales = quantize(x, bits, G, fmt.rotate)
    y = dequantize(codes, scales, bits, G)
    return rotate(y, G) if fmt.rotate else y


def _exact(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """What attention sees of x read from the window: fp16 in the attention domain."""
    if not fmt.rotate:
        return x.half().float()
    return rotate(rotate(x, G).half().float(), G)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int, fmt: KVFormat, scale: float) -> torch.Tensor:
    """Output of query position t [Hq, D] over keys 0..t of one sequence (k, v [L, Hkv, D])."""
    start = t // fmt.window * fmt.window if fmt.window else t + 1           # window 0: all through the codes
    kk = torch.cat([_through_codes(k[:start], fmt.k_bits, fmt), _exact(k[start: t + 1], fmt)])
    vv = torch.cat([_through_codes(v[:start], fmt.v_bits, fmt), _exact(v[start: t + 1], fmt)])
    group = q.shape[0] // k.shape[1]
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)       # [t+1, Hq, D]
    weights = torch.einsum("hd,lhd->hl", q, kk).mul(scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", weights, vv)


# Per forward, per sequence: how many new tokens. Chunks start and end inside blocks of 8,
# cross several blocks, and mix with decode steps of the other sequence.
SCHEDULES = [
    [[13, 20], [1, 5], [1, 1], [9, 1], [1, 30]],
    [[8, 3], [1, 1], [16, 1], [1, 30], [1, 1]],
]


@pytest.mark.parametrize("backend", [TorchKernels, NativeCpuKernels])
@pytest.mark.parametrize("mode,rotation", [("q8", True), ("q6", True), ("q4", True), ("q4", False)])
@pytest.mark.parametrize("schedule", range(len(SCHEDULES)))
def test_windowed_attention_matches_masked_reference(backend, mode, rotation, schedule):
    if backend is NativeCpuKernels and not paged_decode.available():
        pytest.skip("the native kernel is not built here (no C compiler)")
    fmt = KVFormat(f"{mode}-w8", k_bits=KV_FORMATS[mode].k_bits, v_bits=KV_FORMATS[mode].v_bits,
                   rotate=rotation, window=8)
    hq, hkv, d, page_size, scale = 4, 2, 64, 16, 0.125
    g = torch.Generator().manual_seed(schedule * 10 + len(mode))
    steps = SCHEDULES[schedule]
    num_seqs = len(steps[0])
    total = [sum(step[b] for step in steps) for b in range(num_seqs)]
    pages = [list(range(b * 4, b * 4 + -(-total[b] // page_size))) for b in range(num_seqs)]
    layer = LayerKV.allocate(fmt, 4 * num_seqs + 1, page_size, hkv, d, torch.device("cpu"), window_slots=3)
    for t in layer.window_tensors():
        t.fill_(float("nan"))                     # a read of a row not written in this job: NaN
    slots = [2, 0]                                # window blocks of the sequences
    ks = [torch.randn(n, hkv, d, generator=g) for n in total]
    vs = [torch.randn(n, hkv, d, generator=g) for n in total]
    qs = [torch.randn(n, hq, d, generator=g) for n in total]
    done = [0] * num_seqs
    kernels = backend()
    for step in steps:
        order = sorted(range(num_seqs), key=lambda b: step[b] != 1)       # decode rows first
        k = torch.cat([ks[b][done[b]: done[b] + step[b]] for b in order])
        v = torch.cat([vs[b][done[b]: done[b] + step[b]] for b in order])
        q = torch.cat([qs[b][done[b]: done[b] + step[b]] for b in order])
        slot_map = torch.tensor([pages[b][p // page_size] * page_size + p % page_size
                                 for b in order for p in range(done[b], done[b] + step[b])])
        meta = build_metadata([step[b] for b in order], [done[b] + step[b] for b in order],
                              [pages[b] for b in order], page_size, 4 * num_seqs, torch.device("cpu"),
                              window=8, window_slots=[slots[b] for b in order])
        kernels.write_kv(k, v, layer, slot_map)
        if backend is NativeCpuKernels and meta.num_decode:
            assert paged_decode.supported(rotate(q, G) if rotation else q, layer)
        out = kernels.attention(q, layer, meta, scale, k, v)
        assert torch.isfinite(out).all()
        row = 0
        for b in order:
            for p in range(done[b], done[b] + step[b]):
                want = _reference(qs[b][p], ks[b][: p + 1], vs[b][: p + 1], p, fmt, scale)
                torch.testing.assert_close(out[row], want, atol=2e-5, rtol=1e-5)
                row += 1
        for b in order:
            done[b] += step[b]


def test_the_window_changes_what_is_read():
    """The reference itself tells the window from the codes apart (else the test above
    could pass with the window ignored)."""
    fmt = kv_format(KV_FORMATS["q4"], window=8)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 64, generator=g), torch.randn(20, 2, 64, generator=g), torch.randn(20, 2, 64, generator=g)
    with_window = _reference(q, k, v, 19, fmt, 0.125)
    codes_only = _reference(q, k, v, 19, kv_format(fmt, window=0), 0.125)
    all_exact = _reference(q, k, v, 19, dataclasses.replace(fmt, window=10**6), 0.125)
    assert not torch.allclose(with_window, codes_only, atol=1e-3)
    assert not torch.allclose(with_window, all_exact, atol=1e-3)


# --- the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_kv32_dir) -> Model:
    return Model.load(tiny_kv32_dir, dtype="float32")


def test_reuse_stops_at_a_block_boundary(model):
    """A prefix shared up to inside a block is reused up to the block's start; the job then
    equals the same job computed alone."""
    vocab = model.config.vocab_size
    a = random_prompts(1, [37], vocab, seed=3)[0]
    b = a[:29] + random_prompts(1, [9], vocab, seed=4)[0]
    cache = PagedCache(model, max_tokens=16 * 20, page_size=16, mode="q4", window=8)
    cache.fill_unused()
    gen = make_generator_from(model, cache)
    run_jobs(gen, greedy_jobs([a], 3))
    got = run_jobs(gen, greedy_jobs([b], 3, return_logits=True))[0]
    assert got["cached_tokens"] == 24                 # 29 shared, block of 8: 24
    alone = run_jobs(make_generator_from(model, PagedCache(model, max_tokens=16 * 20, page_size=16, mode="q4",
                                                           window=8)), greedy_jobs([b], 3, return_logits=True))[0]
    assert got["all_token_ids"] == alone["all_token_ids"]
    torch.testing.assert_close(got["all_logits"], alone["all_logits"], atol=logit_atol("q4"), rtol=0)


def make_generator_from(model: Model, cache: PagedCache, **kw) -> DynamicGenerator:
    return DynamicGenerator(model, cache, **kw)


def test_window_slots_bound_the_running_jobs(model):
    cache = PagedCache(model, max_tokens=16 * 64, page_size=16, mode="q6", max_jobs=3)
    assert cache.window_slots == 3 and cache.window == 16
    gen = make_generator_from(model, cache, max_batch_size=10)
    prompts = random_prompts(8, [20, 35], model.config.vocab_size, seed=5)
    out = run_jobs(gen, greedy_jobs(prompts, 6))
    assert len(out) == 8 and gen.stats()["peak_batch_size"] == 3
    assert sorted(gen.scheduler.free_windows) == [0, 1, 2]          # every block given back


def test_window_zero_is_the_plain_scheme(model):
    """window=0 allocates no store and reads every key through the codes: its logits differ
    from the windowed mode's, and equal a cache built from the window-less format."""
    prompts = random_prompts(2, [40, 23], model.config.vocab_size, seed=6)
    outs = {}
    for name, kwargs in {"w0": {"mode": "q4", "window": 0}, "fmt": {"mode": kv_format("q4", window=0)},
                         "w16": {"mode": "q4"}}.items():
        cache = PagedCache(model, max_tokens=16 * 16, page_size=16, **kwargs)
        assert (cache.window_memory_bytes() == 0) == (name != "w16")
        outs[name] = run_jobs(make_generator_from(model, cache), greedy_jobs(prompts, 4, return_logits=True))
    for i in range(2):
        assert torch.equal(outs["w0"][i]["all_logits"], outs["fmt"][i]["all_logits"])
        assert not torch.allclose(outs["w0"][i]["all_logits"], outs["w16"][i]["all_logits"], atol=1e-4)


@pytest.mark.parametrize("kwargs,needle", [
    ({"mode": "q4", "window": 24}, "page size 16 is not a multiple of 24"),
    ({"mode": "fp32", "window": 8}, "is exact"),
    ({"mode": "q4", "window": -1}, "window must be an integer >= 0"),
    ({"mode": "q4", "max_jobs": 0}, "max_jobs must be None or an integer >= 1"),
])
def test_bad_window_settings_are_named(model, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PagedCache(model, max_tokens=256, page_size=16, **kwargs)


def test_window_slots_never_exceed_the_pages(model):
    """A running job holds at least one page, so more store blocks than pages are never used."""
    assert PagedCache(model, max_tokens=16 * 5, page_size=16, mode="q4", max_jobs=256).window_slots == 5
    assert PagedCache(model, max_tokens=16 * 5, page_size=16, mode="q4").window_slots == 5


def test_an_explicit_format_window_is_not_refitted(model):
    with pytest.raises(ValueError, match="page size 16 is not a multiple of 24"):
        PagedCache(model, max_tokens=256, page_size=16, mode=kv_format("q4", window=24))


def test_default_window_is_fitted_to_the_page(model):
    assert KV_FORMATS["q4"].window == 128
    assert PagedCache(model, max_tokens=1024, page_size=256, mode="q4").window == 128
    assert PagedCache(model, max_tokens=1024, page_size=16, mode="q4").window == 16
    assert PagedCache(model, max_tokens=1000, page_size=100, mode="q4").window == math.gcd(128, 100)


# --- the CLI --------------------------------------------------------------------------------

def _mmlu(model_dir: Path, out: Path, *extra: str) -> int:
    try:
        return main(["mmlu", "--model", str(model_dir), "--data-dir", str(FIXTURE), "--output-dir", str(out),
                     "--no-progress", "--subjects", "nutrition", "--limit", "2", "--page-size", "16", *extra])
    except SystemExit as exc:
        return exc.code


def test_cli_records_the_window_and_resumes_only_with_it(tiny_kv32_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _mmlu(tiny_kv32_dir, out, "--cache-mode", "q4", "--cache-window", "8") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["cache_window"] == 8 and manifest["cache_window"] == 8
    assert "the current block of 8 tokens exact" in manifest["cache_format"]
    assert manifest["cache_window_bytes_per_job"] == 2 * 2 * 8 * 2 * 32 * 2       # K,V x layers x W x heads x D x fp16
    capsys.readouterr()
    assert _mmlu(tiny_kv32_dir, out, "--cache-mode", "q4", "--cache-window", "0") == 2
    assert "cache_window" in capsys.readouterr().err
    assert _mmlu(tiny_kv32_dir, out, "--cache-mode", "q4") == 0             # resumed: the stored window
    assert json.loads((out / "manifest.json").read_text())["identity"]["cache_window"] == 8
    fp = tmp_path / "fp"
    assert _mmlu(tiny_kv32_dir, fp, "--cache-mode", "fp32") == 0
    assert "cache_window" not in json.loads((fp / "manifest.json").read_text())["identity"]


@pytest.mark.parametrize("argv,needle", [
    (["--cache-mode", "q4", "--cache-window", "12"], "page size 16 is not a multiple of 12"),
    (["--cache-mode", "fp32", "--cache-window", "8"], "is exact"),
    (["--cache-mode", "q8", "--cache-window", "-8"], "--cache-window must be >= 0"),
])
def test_cli_bad_window_exits_2_naming_it(tiny_kv32_dir, tmp_path, capsys, argv, needle):
    assert _mmlu(tiny_kv32_dir, tmp_path / "o", *argv) == 2
    err = capsys.readouterr().err
    assert needle in err.strip().splitlines()[-1] and "Traceback" not in err


def test_windowed_attention_keeps_every_tensor_on_the_cache_device():
    """On the meta device (shapes only, no GPU needed) every op must find its operands on one
    device: a CPU index tensor meeting a device cache fails here as it would on CUDA."""
    dev = torch.device("meta")
    layer = LayerKV.allocate(kv_format("q4", window=8), 5, 16, 2, 64, dev, window_slots=2)
    for q_lens, lens in (([13], [13]), ([1, 5], [9, 21])):               # prefill; decode + prefill
        q, k, v = (torch.empty(sum(q_lens), h, 64, device=dev) for h in (4, 2, 2))
        meta = build_metadata(q_lens, lens, [[0, 1]] * len(lens), 16, 4, dev, window=8,
                              window_slots=list(range(len(lens))))
        assert TorchKernels().attention(q, layer, meta, 0.125, k, v).shape == (sum(q_lens), 4, 64)
