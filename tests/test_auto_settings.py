"""`auto` device/dtype/cache choices: every CPU-flag case and CUDA (mocked), and resumes."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from evalrun.engine.auto import HostFacts, SettingError, choose_cache_mode, choose_device, choose_dtype, host_facts
from evalrun.run.engine_config import EngineRequest, engine_config
from evalrun.errors import BadInput

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
ZEN5 = AVX2 | {"avx512f", "avx512bw", "avx512_bf16"}
SAPPHIRE = AVX2 | {"avx512f", "amx_tile", "amx_bf16", "amx_int8"}     # AMX-BF16 without AVX512-BF16 listed
AVX512_NO_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}

CPU_ONLY = HostFacts(AVX2, cuda_available=False, torch_cuda_build=None)
MODES = ("fp32", "bf16", "fp16")


@pytest.mark.parametrize("flags,expected", [
    (AVX2, "float32"),
    (AVX512_NO_BF16, "float32"),
    (ZEN5, "bfloat16"),
    (SAPPHIRE, "bfloat16"),
    (frozenset(), "float32"),
    (None, "float32"),                      # /proc/cpuinfo unreadable: the safe choice
])
def test_auto_dtype_on_cpu_follows_the_cpu_flags(flags, expected):
    """Without the dtype probe's figures (facts built by hand): the flag rule."""
    choice = choose_dtype("auto", "cpu", HostFacts(flags, False, None))
    assert choice.value == expected and choice.requested == "auto" and choice.reason
    assert choice.probe is None
    if expected == "bfloat16":
        assert choice.reason.endswith("(not measured)")


def test_auto_dtype_on_cuda_is_bfloat16_whatever_the_cpu():
    assert choose_dtype("auto", "cuda", HostFacts(AVX2, True, "12.8")).value == "bfloat16"
    assert choose_dtype("auto", "cuda:1", HostFacts(None, True, "12.8")).value == "bfloat16"


def test_explicit_dtype_is_kept_and_checked():
    assert choose_dtype("bfloat16", "cpu", CPU_ONLY).value == "bfloat16"     # the user's word wins
    with pytest.raises(SettingError, match="--dtype must be"):
        choose_dtype("int4", "cpu", CPU_ONLY)


def test_auto_device_means_cpu_and_says_why():
    with_gpu = choose_device("auto", HostFacts(AVX2, True, "12.8"))
    assert with_gpu.value == "cpu" and "not yet verified" in with_gpu.reason
    assert choose_device("auto", CPU_ONLY).value == "cpu"
    assert choose_device("cuda", HostFacts(AVX2, True, "12.8")).value == "cuda"


@pytest.mark.parametrize("facts,needle", [(CPU_ONLY, "CPU-only build"),
                                          (HostFacts(AVX2, False, "12.8"), "sees no GPU")])
def test_cuda_without_a_gpu_is_refused_in_one_line(facts, needle):
    with pytest.raises(SettingError) as err:
        choose_device("cuda:0", facts)
    assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SettingError, match="--device must be"):
        choose_device("tpu", facts)


@pytest.mark.parametrize("dtype,mode", [("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16")])
def test_auto_cache_mode_is_the_storage_of_the_dtype(dtype, mode):
    assert choose_cache_mode("auto", dtype, MODES).value == mode
    assert choose_cache_mode("fp32", dtype, MODES).value == "fp32"


def test_host_facts_read_this_machine():
    """Checked against /proc/cpuinfo and torch, read here independently."""
    import torch
    facts = host_facts()
    assert facts.cuda_available == torch.cuda.is_available()
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        assert facts.cpu_flags is None
        return
    lines = [ln for ln in cpuinfo.read_text().splitlines() if ln.split(":")[0].strip() in ("flags", "Features")]
    assert facts.cpu_flags == frozenset(lines[0].split(":", 1)[1].split())
    has_bf16 = "avx512_bf16" in lines[0] or "amx_bf16" in lines[0]
    assert facts.dtype_probe is None and facts.dtype_probe_skipped is None      # host_facts() measures nothing
    assert choose_dtype("auto", "cpu", facts).value == ("bfloat16" if has_bf16 else "float32")


def _args(**kw) -> EngineRequest:
    base = dict(device="auto", dtype="auto", cache_mode="auto", cache_tokens=4096, page_size=16,
                max_batch_size=None, max_chunk_size=512)
    return EngineRequest(**{**base, **kw})


def test_engine_config_resolves_every_auto(tmp_path):
    cfg = engine_config(_args(), None, tmp_path, facts=HostFacts(ZEN5, False, None))
    assert (cfg.device, cfg.dtype, cfg.cache_mode) == ("cpu", "bfloat16", "bf16")
    rec = cfg.choices_record()
    assert rec["dtype"] == {"requested": "auto", "value": "bfloat16",
                            "reason": "the CPU has avx512_bf16 (not measured)"}
    assert "auto" not in (cfg.device, cfg.dtype, cfg.cache_mode)
    assert "dtype bfloat16 (auto: the CPU has avx512_bf16 (not measured))" in cfg.describe()


def test_a_resume_with_auto_keeps_the_stored_values(tmp_path):
    """A run started on a bf16 CPU resumes in bf16 on an AVX2-only CPU, and vice versa."""
    stored = {"identity": {"device": "cpu", "dtype": "bfloat16", "cache_mode": "bf16"}}
    cfg = engine_config(_args(), stored, tmp_path, facts=CPU_ONLY)
    assert (cfg.dtype, cfg.cache_mode) == ("bfloat16", "bf16")
    assert str(tmp_path) in cfg.choices["dtype"].reason
    stored32 = {"identity": {"device": "cpu", "dtype": "float32", "cache_mode": "fp32"}}
    assert engine_config(_args(), stored32, tmp_path, facts=HostFacts(ZEN5, False, None)).dtype == "float32"
    explicit = engine_config(_args(dtype="float16"), stored, tmp_path, facts=CPU_ONLY)   # mismatch named later
    assert explicit.dtype == "float16"


def test_a_stored_cuda_run_resumed_without_a_gpu_is_refused(tmp_path):
    stored = {"identity": {"device": "cuda", "dtype": "bfloat16", "cache_mode": "bf16"}}
    with pytest.raises(BadInput, match="was made with device 'cuda', which this host cannot resume"):
        engine_config(_args(), stored, tmp_path, facts=CPU_ONLY)
    cfg = engine_config(_args(), stored, tmp_path, facts=HostFacts(AVX2, True, "12.8"))
    assert cfg.device == "cuda"


@pytest.mark.parametrize("kw,needle", [({"cache_tokens": 0}, "--cache-tokens"), ({"page_size": 0}, "--page-size"),
                                       ({"max_batch_size": 0}, "--max-batch-size"),
                                       ({"cache_tokens": 8, "page_size": 16}, "at least --page-size")])
def test_engine_config_checks_numbers(tmp_path, kw, needle):
    with pytest.raises(BadInput, match=needle):
        engine_config(_args(**kw), None, tmp_path, facts=CPU_ONLY)


def test_python_api_accepts_auto(tiny_model_dir):
    from evalrun.engine import Model, PagedCache
    model = Model.load(tiny_model_dir, dtype="auto")
    expected = choose_dtype("auto", "cpu", host_facts()).value
    assert str(model.dtype) == f"torch.{expected}"
    cache = PagedCache(model, max_tokens=64, page_size=16, mode="auto")
    assert cache.k[0].dtype == model.dtype and cache.mode == {"float32": "fp32", "bfloat16": "bf16"}[expected]


@pytest.mark.parametrize("device,needle", [("cuda:abc", "--device must be"), ("cuda:-1", "--device must be"),
                                           ("cpu:0", "--device must be"), ("cuda:2", "has 2 CUDA device(s)")])
def test_device_names_and_indexes_are_checked(device, needle):
    with pytest.raises(SettingError, match=re.escape(needle)):
        choose_device(device, HostFacts(AVX2, True, "12.8", cuda_devices=2))
    assert choose_device("cuda:1", HostFacts(AVX2, True, "12.8", cuda_devices=2)).value == "cuda:1"
