"""benchmarks/ab_gemm_bf16 and benchmarks/kernel_builds: variants parse, build and must agree bitwise."""
from __future__ import annotations

import pytest

from benchmarks import ab_gemm_bf16, kernel_builds
from evalrun.kernels.cpu import gemm_bf16, native

needs_build = pytest.mark.skipif(not gemm_bf16.available() or native.compiler() is None,
                                 reason="the native bf16 GEMM does not build here")


def test_variants_parse():
    vs = kernel_builds.parse_variants("base=; kc64=-DBF_KC=64 -DBF_CHUNKS=4;old=@/tmp/x.c")
    assert [v.name for v in vs] == ["base", "kc64", "old"]
    assert vs[0].defines == "" and vs[0].source is None
    assert vs[1].defines == "-DBF_KC=64 -DBF_CHUNKS=4"
    assert str(vs[2].source) == "/tmp/x.c" and vs[2].defines == ""
    for bad in ("", "base", "=-DX", "a=;a=-DX"):
        with pytest.raises(ValueError):
            kernel_builds.parse_variants(bad)


@needs_build
def test_builds_alternate_and_must_agree(tmp_path):
    args = ["--rows", "5", "--trials", "2", "--shapes", "48x40,40x96", "--layers", "2"]
    result = ab_gemm_bf16.main(["--variants", "base=;kc8=-DBF_KC=8 -DBF_CHUNKS=1", *args,
                                "--out", str(tmp_path / "ab.json")])
    assert set(result["variants"]) == {"base", "kc8"}
    assert result["variants"]["base"]["paired_vs_first"] == 1.0
    # a copy of the source that rounds its rows differently gives other bits: refused, not timed
    planted = tmp_path / "gemm_bf16.c"
    text = ab_gemm_bf16.SOURCE.read_text()
    line = "store_bf16((const float *)x + (int64_t)m * ldx, dst, K);"
    assert line in text
    planted.write_text(text.replace(line, line + " dst[0] ^= 1;"))
    with pytest.raises(SystemExit, match="does not give the bits of base"):
        ab_gemm_bf16.main(["--variants", f"base=;planted=@{planted}", *args, "--out", str(tmp_path / "ab2.json")])
