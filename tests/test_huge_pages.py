"""evalrun/kernels/cpu/huge_pages.py: large CPU buffers start on a 2 MiB boundary and (Linux) are backed by
huge pages when the kernel's THP mode allows; small ones, other devices and EVALRUN_HUGE_PAGES=0
are plain torch.empty. Only the backing changes: shapes, dtypes and what is written read back."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from evalrun.kernels.cpu import gemm, huge_pages
from evalrun.kernels.kv_format import KV_FORMATS, LayerKV


def _anon_huge_kb() -> int:
    return sum(int(x) for x in re.findall(r"AnonHugePages:\s+(\d+)", Path("/proc/self/smaps").read_text()))


def test_large_buffers_are_aligned_and_hold_what_is_written():
    t = huge_pages.empty((3, 1024, 1024), torch.float32)
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    if huge_pages.enabled():
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    assert torch.equal(t.flatten()[-5:], torch.arange(t.numel() - 5, t.numel(), dtype=torch.float32))


def test_small_buffers_and_the_switch_give_plain_empty(monkeypatch):
    small = huge_pages.empty((16, 16), torch.float16)
    assert small.shape == (16, 16) and small.dtype == torch.float16
    monkeypatch.setenv("EVALRUN_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    big = huge_pages.empty((1024, 1024), torch.float32)
    assert big.untyped_storage().nbytes() == big.numel() * 4          # no aligned slice of a larger block


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_the_kv_cache_is_on_huge_pages_where_thp_is_not_off():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    if not huge_pages.enabled():
        pytest.skip("EVALRUN_HUGE_PAGES=0")
    probe = huge_pages.empty((huge_pages.HUGE_PAGE,), torch.uint8)
    assert huge_pages._madvise(probe.data_ptr(), huge_pages.HUGE_PAGE)     # the kernel takes the advice
    before = _anon_huge_kb()
    layer = LayerKV.allocate(KV_FORMATS["fp32"], 65, 256, 3, 64, torch.device("cpu"))    # 12.8 MB per tensor
    layer.k.fill_(1.0)
    got = _anon_huge_kb() - before
    assert torch.equal(layer.k[-1], torch.ones_like(layer.k[-1]))
    if got == 0:
        pytest.skip("the kernel found no free 2 MiB pages just now (fragmented memory): 4 KiB pages, as without")
    assert got >= 8 * 1024                                            # most of k's 12.8 MB on 2 MiB pages


@pytest.mark.skipif(not gemm.available(), reason="the native GEMM is not built on this machine")
def test_packed_weights_on_huge_pages_give_the_same_outputs(monkeypatch):
    w = torch.randn(1536, 576)
    x = torch.randn(32, 576)
    on = gemm.gemm(x, gemm.pack(w), 1536)
    monkeypatch.setenv("EVALRUN_HUGE_PAGES", "0")
    assert torch.equal(on, gemm.gemm(x, gemm.pack(w), 1536))


@pytest.mark.parametrize("mode", ["fp32", "q4"])
def test_prefault_writes_every_page_and_changes_no_result(tiny_kv32_dir, mode):
    """PagedCache.prefault() maps the pages before a run: every storage tensor (codes and scales
    too) reads zero afterwards, the null page included, and a run on it gives bitwise the logits
    of a run on a cache whose unused slots hold NaN."""
    from evalrun.engine import DynamicGenerator, Model, PagedCache
    from tests.engine_helpers import greedy_jobs, make_generator, random_prompts, run_jobs

    model = Model.load(tiny_kv32_dir, dtype="float32")
    cache = PagedCache(model, max_tokens=512, page_size=16, mode=mode)
    cache.fill_unused()
    assert cache.prefault() >= 0.0
    for layer in cache.layers:
        for t in layer.tensors():
            assert not t.float().isnan().any() and int(t.count_nonzero()) == 0
    prompts = random_prompts(3, [5, 21, 37], model.config.vocab_size, seed=3)
    got = run_jobs(DynamicGenerator(model=model, cache=cache), greedy_jobs(prompts, 6, return_logits=True))
    want = run_jobs(make_generator(model, max_tokens=512, mode=mode), greedy_jobs(prompts, 6, return_logits=True))
    for i in range(3):
        assert got[i]["all_token_ids"] == want[i]["all_token_ids"]
        assert torch.equal(got[i]["all_logits"], want[i]["all_logits"])
