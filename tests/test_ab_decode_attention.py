"""benchmarks/ab_decode_attention: variants of paged_decode.c build, alternate and must agree bitwise."""
from __future__ import annotations

import pytest

from benchmarks import ab_decode_attention
from evalrun.kernels.cpu import native, paged_decode

needs_build = pytest.mark.skipif(not paged_decode.available() or native.compiler() is None,
                                 reason="the native paged decode kernel does not build here")
SMALL = ["--rows", "3", "--context", "300", "--layers", "2", "--trials", "2"]


@needs_build
def test_variants_alternate_and_a_changed_result_is_refused(tmp_path):
    result = ab_decode_attention.main(["--variants", "base=;pf16=-DSTREAM_PFD=16", *SMALL,
                                       "--out", str(tmp_path / "ab.json")])
    assert set(result["results"]) == {"base", "pf16"} and result["results"]["base"]["ratio_to_first"] == 1.0
    assert result["kv_bytes_per_trial"] == 2 * 2 * 3 * 300 * 3 * 64 * 4      # K and V, layers, rows, positions


@needs_build
def test_a_copy_with_other_results_is_refused(tmp_path):
    planted = tmp_path / "paged_decode.c"
    text = ab_decode_attention.SOURCE.read_text()
    line = "    if (nthreads < 1) nthreads = 1;"          # in paged_decode(): every path reads the scale
    assert text.count(line) == 1
    planted.write_text(text.replace(line, "    scale *= 2.0f;\n" + line))
    with pytest.raises(SystemExit, match="planted's outputs differ"):
        ab_decode_attention.main(["--variants", f"base=;planted=@{planted}", *SMALL, "--kv", "bf16",
                                  "--out", str(tmp_path / "ab2.json")])
