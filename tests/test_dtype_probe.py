"""The `--dtype auto` probe (evalrun/engine/dtype_probe.py): cached once per CPU and kernel, the
choice follows its figures, it runs only where an auto dtype on a native-bf16 CPU needs it, and
the manifest's engine_choices carry its figures. No timing is asserted (benchmarks/ does that)."""
from __future__ import annotations

import json

import pytest
import torch

from evalrun.engine import auto, dtype_probe
from evalrun.engine.auto import HostFacts, choose_deterministic, choose_dtype, with_dtype_probe
from evalrun.engine.dtype_probe import BF16_MARGIN, ProbeResult, Timing
from evalrun.errors import BadInput
from evalrun.run import engine_config as engine_config_mod
from evalrun.run.engine_config import EngineRequest, engine_config

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
ZEN5 = AVX2 | {"avx512f", "avx512bw", "avx512_bf16"}
SAPPHIRE = AVX2 | {"avx512f", "amx_tile", "amx_bf16"}


def fake_result(ratio: float, measured: str = "2026-12-04", cached: bool = False) -> ProbeResult:
    """Figures whose bf16 total is `ratio` x float32's: two shapes, float32 1 ms and 3 ms."""
    timings = (Timing("qkv", (960, 576), 1, 0.001, 0.001 * ratio),
               Timing("down", (576, 1536), 256, 0.003, 0.003 * ratio))
    return ProbeResult(timings, "native-gemm", "torch", measured, cached=cached, path=None)


class Counter:
    """A stand-in for measure_linears that counts its calls."""

    def __init__(self, ratio: float = 0.41):
        self.calls, self.ratio = 0, ratio

    def __call__(self) -> ProbeResult:
        self.calls += 1
        return fake_result(self.ratio)


@pytest.fixture
def counter(monkeypatch, tmp_path):
    monkeypatch.setenv("EVALRUN_CACHE", str(tmp_path))
    monkeypatch.delenv("EVALRUN_DTYPE_PROBE", raising=False)
    fake = Counter()
    monkeypatch.setattr(dtype_probe, "measure_linears", fake)
    return fake


def test_the_cache_is_written_once_and_reused(counter, tmp_path):
    first = dtype_probe.probe(ZEN5)
    assert counter.calls == 1 and not first.cached
    path = tmp_path / "dtype-probe" / f"{dtype_probe.cache_path(dtype_probe.cache_key(ZEN5)).name}"
    assert first.path == str(path) and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]          # no temp file left behind
    second = dtype_probe.probe(ZEN5)
    assert counter.calls == 1 and second.cached and second.path == str(path)
    assert second.timings == first.timings and second.ratio == pytest.approx(0.41)
    assert (second.float32_backend, second.bfloat16_backend, second.measured) == ("native-gemm", "torch",
                                                                                "2026-12-04")
    stored = json.loads(path.read_text())
    assert stored["key"] == dtype_probe.cache_key(ZEN5) and stored["key"]["torch"] == torch.__version__


def test_a_changed_key_measures_again(counter, monkeypatch):
    dtype_probe.probe(ZEN5)
    dtype_probe.probe(SAPPHIRE)                                 # other CPU flags
    assert counter.calls == 2
    monkeypatch.setattr(dtype_probe, "kernel_sources_hash", lambda: "a new kernel")
    assert not dtype_probe.probe(ZEN5).cached and counter.calls == 3
    monkeypatch.setattr(dtype_probe, "cpu_model_name", lambda: "another CPU")
    assert not dtype_probe.probe(ZEN5).cached and counter.calls == 4
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert not dtype_probe.probe(ZEN5).cached and counter.calls == 5
    monkeypatch.setenv("EVALRUN_LINEAR", "onednn")             # another float32 linear
    assert not dtype_probe.probe(ZEN5).cached and counter.calls == 6
    assert dtype_probe.probe(ZEN5).cached and counter.calls == 6


def test_the_kernel_hash_covers_the_c_sources_and_linear_py():
    assert len(dtype_probe.kernel_sources_hash()) == 64
    assert dtype_probe.kernel_sources_hash() == dtype_probe.kernel_sources_hash()


@pytest.mark.parametrize("text", ["{not json", "", '{"key": 1}', "[]", '{"key": null, "result": {}}'])
def test_a_corrupt_cache_file_is_measured_over(counter, text):
    path = dtype_probe.cache_path(dtype_probe.cache_key(ZEN5))
    path.parent.mkdir(parents=True)
    path.write_text(text)
    result = dtype_probe.probe(ZEN5)
    assert counter.calls == 1 and not result.cached and result.ratio == pytest.approx(0.41)
    assert dtype_probe.probe(ZEN5).cached and counter.calls == 1          # rewritten whole


def test_a_same_key_file_with_bad_figures_is_measured_over(counter):
    key = dtype_probe.cache_key(ZEN5)
    path = dtype_probe.cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": key, "result": {"timings": [{"linear": "qkv"}]}}))
    assert not dtype_probe.probe(ZEN5).cached and counter.calls == 1


def test_an_unwritable_cache_still_gives_figures(counter, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EVALRUN_CACHE", str(blocker))                    # a file, not a folder
    result = dtype_probe.probe(ZEN5)
    assert result.path is None and not result.cached and counter.calls == 1


@pytest.mark.parametrize("ratio,expected", [(0.41, "bfloat16"), (0.89, "bfloat16"), (BF16_MARGIN, "float32"),
                                            (0.95, "float32"), (2.0, "float32")])
def test_the_choice_follows_the_measured_figures(ratio, expected):
    for flags, name in ((ZEN5, "avx512_bf16"), (SAPPHIRE, "amx_bf16")):
        facts = HostFacts(flags, False, None, dtype_probe=fake_result(ratio, cached=True))
        choice = choose_dtype("auto", "cpu", facts)
        assert choice.value == expected and choice.probe is facts.dtype_probe
        assert f"bf16 linears {ratio:.2f}x float32's time on this CPU (measured 2026-12-04, cached)" in choice.reason
        assert name in choice.reason
        if expected == "float32":
            assert f"below {BF16_MARGIN}x" in choice.reason
    fresh = choose_dtype("auto", "cpu", HostFacts(ZEN5, False, None, dtype_probe=fake_result(ratio)))
    assert "2026-12-04, fresh)" in fresh.reason


def test_figures_do_not_override_an_explicit_dtype_or_cuda():
    facts = HostFacts(ZEN5, True, "12.8", 1, dtype_probe=fake_result(2.0))
    assert choose_dtype("bfloat16", "cpu", facts).value == "bfloat16"
    assert choose_dtype("auto", "cuda", facts).value == "bfloat16"


def test_no_probe_on_a_cpu_without_native_bf16():
    def boom():
        raise AssertionError("measured on a CPU without native bf16")
    for flags in (AVX2, frozenset(), None):
        facts = HostFacts(flags, False, None)
        assert with_dtype_probe(facts, boom) == facts
        assert choose_dtype("auto", "cpu", facts).value == "float32"


def test_the_probe_can_be_switched_off(counter, monkeypatch):
    monkeypatch.setenv("EVALRUN_DTYPE_PROBE", "0")
    facts = with_dtype_probe(HostFacts(ZEN5, False, None))
    assert counter.calls == 0 and facts.dtype_probe is None
    choice = choose_dtype("auto", "cpu", facts)
    assert choice.value == "bfloat16" and choice.probe is None
    assert choice.reason == "the CPU has avx512_bf16 (not measured: EVALRUN_DTYPE_PROBE=0)"


def test_a_failing_probe_falls_back_to_the_flags(counter):
    def broken():
        raise RuntimeError("no kernel")
    facts = with_dtype_probe(HostFacts(ZEN5, False, None), broken)
    choice = choose_dtype("auto", "cpu", facts)
    assert choice.value == "bfloat16" and "the probe failed: no kernel" in choice.reason


def _args(**kw) -> EngineRequest:
    return EngineRequest(**{**dict(cache_tokens=4096, page_size=16, max_chunk_size=512), **kw})


@pytest.fixture
def zen5_host(monkeypatch, counter):
    """This host as read by engine_config (facts=None), with ZEN5's flags and counted fake figures."""
    monkeypatch.setattr(auto, "cpu_flags", lambda: ZEN5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return counter


def test_engine_config_probes_only_for_an_auto_dtype_on_the_cpu(zen5_host, tmp_path):
    run_dir = tmp_path / "run"
    for req in (_args(dtype="float32"), _args(dtype="bfloat16")):
        engine_config(req, None, run_dir)
    with pytest.raises(BadInput, match="no CUDA device"):       # refused after the facts were read
        engine_config(_args(device="cuda"), None, run_dir)
    stored = {"identity": {"device": "cpu", "dtype": "float32", "cache_mode": "fp32"}}
    assert engine_config(_args(), stored, run_dir).dtype == "float32"          # a resume keeps its dtype
    assert zen5_host.calls == 0
    assert engine_config(_args(), None, run_dir).dtype == "bfloat16"
    assert zen5_host.calls == 1


def test_no_probe_on_this_host_without_bf16_flags(monkeypatch, counter, tmp_path):
    monkeypatch.setattr(auto, "cpu_flags", lambda: AVX2)
    cfg = engine_config(_args(), None, tmp_path)
    assert cfg.dtype == "float32" and counter.calls == 0 and "probe" not in cfg.choices_record()["dtype"]


def test_the_choices_record_carries_the_figures(zen5_host, tmp_path):
    cfg = engine_config(_args(), None, tmp_path / "run")
    rec = cfg.choices_record()["dtype"]
    assert (rec["requested"], rec["value"]) == ("auto", "bfloat16") and "0.41x" in rec["reason"]
    probe = rec["probe"]
    assert probe["ratio"] == pytest.approx(0.41) and probe["margin"] == BF16_MARGIN
    assert probe["seconds"][0] == {"linear": "qkv", "shape": [960, 576], "rows": 1, "float32": 0.001,
                                   "bfloat16": pytest.approx(0.00041)}
    assert probe["float32_total_s"] == pytest.approx(0.004) and probe["bfloat16_total_s"] == pytest.approx(0.00164)
    assert probe["backends"] == {"float32": "native-gemm", "bfloat16": "torch"}
    assert probe["cached"] is False and probe["measured"] == "2026-12-04"
    assert probe["cache_file"].startswith(str(tmp_path / "dtype-probe"))
    assert json.loads(json.dumps(cfg.choices_record())) == cfg.choices_record()   # the manifest is JSON
    for name in ("device", "cache_mode", "deterministic"):
        assert set(cfg.choices_record()[name]) == {"requested", "value", "reason"}
    again = engine_config(_args(), None, tmp_path / "run").choices_record()["dtype"]["probe"]
    assert again["cached"] is True and zen5_host.calls == 1
    assert "dtype bfloat16 (auto: the CPU has avx512_bf16 and bf16 linears 0.41x" in cfg.describe()


def test_measured_float32_faster_means_float32_with_its_figures(zen5_host, tmp_path):
    zen5_host.ratio = 1.3
    cfg = engine_config(_args(), None, tmp_path)
    assert (cfg.dtype, cfg.cache_mode) == ("float32", "fp32")
    assert "1.30x" in cfg.choices["dtype"].reason and cfg.choices_record()["dtype"]["probe"]["ratio"] == 1.3


def test_deterministic_auto_is_on_where_the_default_linear_is_the_invariant_one():
    zen5 = HostFacts(ZEN5, False, None)
    same = choose_deterministic("auto", "cpu", "bfloat16", zen5, None, ("native-bf16", "native-bf16"))
    assert same.value == "on" and "native-bf16" in same.reason and "no cost" in same.reason
    other = choose_deterministic("auto", "cpu", "bfloat16", zen5, None, ("torch", "native-gemm"))
    assert other.value == "off" and "avx512_bf16" in other.reason and "--deterministic on" in other.reason
    f32 = choose_deterministic("auto", "cpu", "float32", zen5, None, ("native-gemm", "native-gemm"))
    assert f32.value == "on" and "native-gemm" in f32.reason
    assert choose_deterministic("off", "cpu", "bfloat16", zen5, None, ("native-bf16", "native-bf16")).value == "off"
    why = "batch-invariant linears need the native GEMM: no AVX2"
    assert choose_deterministic("auto", "cpu", "float32", zen5, why, ("torch", "native-gemm")).value == "off"


def test_engine_config_asks_the_linear_backends(monkeypatch, tmp_path):
    asked = []

    def backend(device, dtype, invariant=False):
        asked.append((device, dtype, invariant))
        return "native-bf16" if dtype == torch.bfloat16 else "native-gemm"
    monkeypatch.setattr(engine_config_mod, "linear_backend", backend)
    monkeypatch.setattr(engine_config_mod, "invariant_unavailable_reason", lambda device: None)
    cfg = engine_config(_args(dtype="bfloat16"), None, tmp_path, facts=HostFacts(ZEN5, False, None))
    assert cfg.deterministic and "native-bf16" in cfg.choices["deterministic"].reason
    assert asked == [("cpu", torch.bfloat16, False), ("cpu", torch.bfloat16, True)]
    monkeypatch.setattr(engine_config_mod, "linear_backend",
                        lambda device, dtype, invariant=False: "native-gemm" if invariant else "torch")
    cfg = engine_config(_args(dtype="bfloat16"), None, tmp_path, facts=HostFacts(ZEN5, False, None))
    assert not cfg.deterministic                     # oneDNN's bf16 matmul is not the invariant GEMM


def test_a_real_measurement_has_every_shape_and_leaves_the_rng_alone():
    """Runs the kernels once (structure only: the speeds are benchmarks/' business)."""
    state = torch.get_rng_state()
    result = dtype_probe.measure_linears()
    assert torch.equal(torch.get_rng_state(), state)
    assert [(t.linear, t.rows) for t in result.timings] == [(n, r) for n in dtype_probe.SHAPES
                                                            for r in dtype_probe.ROWS]
    assert all(t.float32_s > 0 and t.bfloat16_s > 0 for t in result.timings)
    assert result.float32_backend and result.bfloat16_backend and not result.cached
