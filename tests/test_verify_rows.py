"""Several new tokens of one sequence checked in one forward, the way speculative decoding verifies
a draft (issue 14): each token a row of the decode group, its own pseudo-sequence over the same page
table with the length up to its own position. The K/V of every row is written before any row
attends, so row i sees rows < i, and the logits are bitwise those of feeding the tokens one decode
step at a time (the per-op path and the native whole-step path alike). The same tokens as one
prefill chunk agree only to rounding (another attention kernel)."""
from __future__ import annotations

import pytest
import torch

from benchmarks.verify_rows_cost import forward
from evalrun.engine import Model, PagedCache
from evalrun.kernels.cpu.decode_step import DecodeStep


def _fresh(model, prompt, table):
    cache = PagedCache(model, max_tokens=16 * 64, page_size=16, mode="fp32")
    cache.fill_unused(float("nan"))                         # a row reading past its length would show
    forward(model, cache, prompt, 0, table, as_rows=False)
    return cache


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
@pytest.mark.parametrize("native_step", [True, False])
def test_draft_rows_are_bitwise_one_step_at_a_time(which, native_step, tiny_model_dir, smollm2_dir, monkeypatch):
    model = Model.load(tiny_model_dir if which == "tiny" else smollm2_dir, dtype="float32")
    runs = []
    real_run = DecodeStep.run
    monkeypatch.setattr(DecodeStep, "run", lambda self, *a: runs.append(a[0].shape[0]) or real_run(self, *a))
    if not native_step:
        monkeypatch.setattr(type(model), "_decode_step", lambda self, cache: None)
    g = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (37,), generator=g).tolist()
    draft = torch.randint(0, vocab, (6,), generator=g).tolist()
    table = [5, 2, 9, 0]                                    # 64 positions on shuffled pages
    one_cache = _fresh(model, prompt, table)
    one = torch.cat([forward(model, one_cache, [t], len(prompt) + i, table, as_rows=True)
                     for i, t in enumerate(draft)])
    rows_cache = _fresh(model, prompt, table)
    rows = forward(model, rows_cache, draft, len(prompt), table, as_rows=True)
    assert torch.isfinite(rows).all()
    assert torch.equal(rows, one)
    assert runs == ([1] * len(draft) + [len(draft)] if native_step else [])   # the path meant ran
    for i in range(len(model.layers)):                      # and the same K/V left in the pages
        assert torch.equal(rows_cache.layer(i).k[table].nan_to_num(0), one_cache.layer(i).k[table].nan_to_num(0))
    chunk = forward(model, _fresh(model, prompt, table), draft, len(prompt), table, as_rows=False)
    torch.testing.assert_close(chunk, one, atol=1e-4, rtol=1e-4)
