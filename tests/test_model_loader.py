"""The model a run gets is loaded with every setting of its EngineConfig that changes the model.

Two bugs this guards: ModelLoader (one model for a suite's or sweep's runs) keyed the loaded model
on (path, dtype, device) only, so runs differing in --deterministic or --eager reused the first
run's model; and a draft model (--draft-model) was loaded without the --eager setting.
"""
from __future__ import annotations

from typing import Any

import evalrun.engine as engine
from evalrun.run import common
from evalrun.run import pipeline
from evalrun.run.engine_config import EngineConfig
from evalrun.run.pipeline import ModelLoader


def _cfg(**kw: Any) -> EngineConfig:
    return EngineConfig(**{"device": "cpu", "dtype": "float32", "cache_mode": "fp32", **kw})


def test_runs_differing_in_deterministic_get_their_own_model(tiny_model_dir):
    loader = ModelLoader()
    plain, _ = loader.get(_cfg(deterministic=False), tiny_model_dir)
    exact, _ = loader.get(_cfg(deterministic=True), tiny_model_dir)
    assert (plain.deterministic, exact.deterministic) == (False, True)
    assert loader.get(_cfg(deterministic=True), tiny_model_dir)[0] is exact       # same settings: reused
    assert loader.loads == 2


def test_runs_differing_in_eager_get_their_own_model(monkeypatch, tmp_path):
    loaded: list[dict[str, Any]] = []
    monkeypatch.setattr(pipeline, "load_model", lambda cfg, path: loaded.append(cfg.load_settings()) or (object(), None))
    loader = ModelLoader()
    for eager in (False, True, True):
        loader.get(_cfg(device="cuda", eager=eager), tmp_path)      # nothing is loaded on a device here
    assert [s["cuda_graphs"] for s in loaded] == [True, False]
    assert loader.loads == 2


def test_the_draft_model_follows_eager(monkeypatch, tiny_model_dir):
    calls: list[dict[str, Any]] = []

    class Recorded:
        format = "fp32"
        max_tokens = 256
        window_slots = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    def load(path: Any, **kwargs: Any) -> Recorded:
        calls.append(kwargs)
        return Recorded()

    monkeypatch.setattr(engine.Model, "load", staticmethod(load))
    monkeypatch.setattr(common, "PagedCache", Recorded)
    monkeypatch.setattr(common, "DynamicGenerator", Recorded)
    for eager in (True, False):
        calls.clear()
        cfg = _cfg(device="cuda", eager=eager, draft_model=str(tiny_model_dir))
        common.make_generator(cfg, Recorded(), None)
        assert [c["cuda_graphs"] for c in calls] == [not eager], calls      # the draft's load
        assert calls[0] == cfg.load_settings()
