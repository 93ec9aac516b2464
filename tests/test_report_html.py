"""The HTML report of `evalrun compare --format html` (evalrun/results/report_html.py).

Comparisons are built by results.compare.compare_runs from RunData records (manifest + rows,
what load_finished_run returns): an MMLU cache-mode sweep (fp32/q8/q4, exact McNemar path), a
HumanEval pair with several samples per problem (bootstrap path), n = 1 groups (NaN stderr)
and a single run. The acceptance test opens the report in headless Chromium with no network
(`unshare -n`, loopback only), takes a screenshot and checks that every plot area has content.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import pytest

from evalrun.results.compare import Comparison, compare_runs
from evalrun.results.compare_format import render
from evalrun.results.report_html import render_html
from evalrun.results.run_reader import RunData
from evalrun.tasks.registry import HUMANEVAL, MMLU

SUBJECTS = ("anatomy", "astronomy", "philosophy", "world_religions", "econometrics", "marketing", "virology")
SWEEP = (("fp32", 18432), ("q8", 4896), ("q4", 2592))          # cache mode, bytes per token
PLOTS = ("plot-metric", "plot-deltas", "plot-bytes")
RUN_COLOURS = ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C))   # matplotlib's C0, C1, C2


# ------------------------------------------------------------------------------ comparisons

def _manifest(task: str, key_columns: list[str], cache_mode: str, bytes_per_token: Optional[int]) -> dict:
    return {"task": task, "status": "finalized", "key_columns": key_columns, "dtype": "float32",
            "cache_mode": cache_mode, "cache_bytes_per_token": bytes_per_token,
            "model": {"path": "/models/SmolLM2-135M-Instruct"},
            "environment": {"packages": {"evalrun": "0.1.0"}, "git": {"sha": "0123456789abcdef"}},
            "throughput": {"wall_seconds": 12.5, "prompt_tokens": 40000, "generated_tokens": 0,
                           "prefill_tokens_computed": 9000}}


def _mmlu_run(path: Path, mode: str, bytes_per_token: Optional[int], correct: np.ndarray,
              keys: list[tuple[str, int]]) -> RunData:
    rows = pd.DataFrame({"subject": [s for s, _ in keys], "doc_id": [d for _, d in keys], "correct": correct})
    return RunData(path, _manifest("mmlu", ["subject", "doc_id"], mode, bytes_per_token), rows)


def mmlu_sweep(root: Path, labels: Optional[list[str]] = None) -> Comparison:
    """fp32/q8/q4 runs of 7 subjects × 30 questions; q8 and q4 flip 5% and 20% of the answers."""
    rng = np.random.default_rng(11)
    keys = [(s, d) for s in SUBJECTS for d in range(30)]
    base = rng.random(len(keys)) < 0.55
    runs = [_mmlu_run(root / "sweep" / mode, mode, bpt, base ^ (rng.random(len(keys)) < flip), keys)
            for (mode, bpt), flip in zip(SWEEP, (0.0, 0.05, 0.2))]
    return compare_runs(runs, MMLU, by="category", labels=labels)


def humaneval_pair(root: Path) -> Comparison:
    """Two runs, same cache mode, 20 problems × 5 samples: the paired bootstrap path."""
    rng = np.random.default_rng(5)
    keys = [(f"HumanEval/{p}", s) for p in range(20) for s in range(5)]
    runs = []
    for name, rate in (("base", 0.5), ("candidate", 0.4)):
        rows = pd.DataFrame({"task_id": [t for t, _ in keys], "sample_idx": [s for _, s in keys],
                             "passed": rng.random(len(keys)) < rate})
        runs.append(RunData(root / name, _manifest("humaneval", ["task_id", "sample_idx"], "fp32", 18432), rows))
    return compare_runs(runs, HUMANEVAL, n_boot=500)


# ------------------------------------------------------------------------------ parsing

class _Page(HTMLParser):
    """Every start tag with its attributes, and which plot element encloses each tag."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, Optional[str]], Optional[str]]] = []
        self._stack: list[tuple[str, Optional[str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        a = dict(attrs)
        plot = a.get("id") if a.get("id") in PLOTS else (self._stack[-1][1] if self._stack else None)
        self.tags.append((tag, a, plot))
        self._stack.append((tag, plot))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        self.handle_starttag(tag, attrs)
        self._stack.pop()

    def handle_endtag(self, tag: str) -> None:
        while self._stack:
            if self._stack.pop()[0] == tag:
                break


def parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    parser.close()
    return parser


def svgs_in(page: _Page, plot: str) -> int:
    return sum(1 for tag, _, p in page.tags if tag == "svg" and p == plot)


def assert_self_contained(page_text: str) -> None:
    page = parse(page_text)
    assert page.tags, "nothing parsed"
    for tag, attrs, _ in page.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed", "base"), f"<{tag}> in the report"
        for name, value in attrs.items():
            if name in ("src", "href", "xlink:href", "action", "data", "poster", "srcset", "formaction"):
                assert value is not None and (value.startswith("#") or value.startswith("data:")), \
                    f"<{tag} {name}={value!r}> refers outside the page"
    assert not re.search(r"url\(\s*['\"]?(?!#)", page_text), "a CSS url() refers outside the page"
    assert "@import" not in page_text
    assert not re.search(r"(src|href)\s*=\s*['\"]?\s*(https?:)?//", page_text, re.IGNORECASE)


# ------------------------------------------------------------------------------ unit tests

def test_sweep_report_has_every_plot_and_table(tmp_path: Path) -> None:
    c = mmlu_sweep(tmp_path)
    text = render_html(c)
    assert_self_contained(text)
    page = parse(text)
    assert [a["id"] for t, a, _ in page.tags if a.get("id") in PLOTS] == list(PLOTS)
    assert all(svgs_in(page, plot) == 1 for plot in PLOTS)
    ids = [a["id"] for _, a, _ in page.tags if a.get("id")]
    assert len(ids) == len(set(ids)), "element ids clash between the inline SVGs"
    tables = [t for t, _, _ in page.tags if t == "table"]
    rows = [t for t, _, _ in page.tags if t == "tr"]
    assert len(tables) == 2 and len(rows) == (1 + len(c.runs)) + (1 + len(c.results))
    for group in ("humanities", "other", "social_sciences", "stem", "overall"):
        assert f"<td>{group}</td>" in text
    assert "exact McNemar test" in text


def test_report_is_deterministic_and_is_the_html_format(tmp_path: Path) -> None:
    c = mmlu_sweep(tmp_path)
    first = render_html(c)
    assert render_html(mmlu_sweep(tmp_path)) == first
    assert render(c, "html") == first


def test_labels_are_escaped(tmp_path: Path) -> None:
    c = mmlu_sweep(tmp_path, labels=["runs/<b>fp32</b>", "runs/q8&co", "runs/\"q4\""])
    text = render_html(c)
    assert_self_contained(text)
    assert "<b>" not in text and "q8&co" not in text
    assert "runs/&lt;b&gt;fp32&lt;/b&gt;" in text and "runs/q8&amp;co" in text and "runs/&quot;q4&quot;" in text


def test_bootstrap_comparison_without_a_sweep(tmp_path: Path) -> None:
    c = humaneval_pair(tmp_path)
    assert c.method == "bootstrap"
    text = render_html(c)
    assert_self_contained(text)
    page = parse(text)
    assert svgs_in(page, "plot-metric") == 1 and svgs_in(page, "plot-deltas") == 1
    assert not any(a.get("id") == "plot-bytes" for _, a, _ in page.tags), "one cache mode is not a sweep"
    assert "paired bootstrap" in text and "pass@1" in text


def test_nan_stderr_groups_and_a_single_run(tmp_path: Path) -> None:
    keys = [("anatomy", 0), ("philosophy", 0), ("marketing", 0), ("marketing", 1)]   # n = 1 groups
    runs = [_mmlu_run(tmp_path / m, m, bpt, np.array(ok), keys)
            for (m, bpt), ok in zip(SWEEP, ([True, False, True, False], [True, True, False, False]))]
    pair = compare_runs(runs[:2], MMLU, by="subject")
    assert any(r.stderr != r.stderr for r in pair.results), "expected NaN stderr in n = 1 groups"
    page = parse(render_html(pair))
    assert all(svgs_in(page, plot) == 1 for plot in PLOTS)

    single = compare_runs(runs[:1], MMLU, by="category")
    text = render_html(single)
    assert_self_contained(text)
    page = parse(text)
    assert svgs_in(page, "plot-metric") == 1
    assert svgs_in(page, "plot-deltas") == 0 and "nothing to compare against" in text
    assert not any(a.get("id") == "plot-bytes" for _, a, _ in page.tags)


# ------------------------------------------------------------------------------ headless Chromium

PROBE = """<script>
const boxes = {};
for (const id of %s) {
  const svg = document.querySelector('#' + id + ' svg');
  if (svg) { const r = svg.getBoundingClientRect(); boxes[id] = [r.left, r.top, r.width, r.height]; }
}
document.body.setAttribute('data-probe', JSON.stringify({boxes: boxes,
  height: document.documentElement.scrollHeight, fetches: performance.getEntriesByType('resource').length}));
</script>
"""
WIDTH = 1200


def _browser() -> list[str]:
    for name, flags in (("chromium-headless-shell", []), ("chromium", ["--headless"])):
        path = shutil.which(name)
        if path:
            return [path, *flags, "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--force-device-scale-factor=1"]
    pytest.skip("no headless Chromium on PATH (apt-get install -y chromium-headless-shell)")


def _offline(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run a browser command in a private network namespace where only loopback exists."""
    return subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def _require_unshare(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2) to run Chromium without network")
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"`unshare -n` is not permitted here: {probe.stderr.strip()}")


def _probe(browser: list[str], report: Path, tmp_path: Path) -> dict:
    page = tmp_path / "probe.html"
    page.write_text(report.read_text().replace("</body>", PROBE % json.dumps(list(PLOTS)) + "</body>"))
    done = _offline([*browser, f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WIDTH},1000",
                     "--dump-dom", page.as_uri()], tmp_path)
    found = re.search(r'data-probe="([^"]*)"', done.stdout)
    assert found, f"the probe page did not run: rc {done.returncode}, {done.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def _screenshot(browser: list[str], page: Path, height: int, tmp_path: Path) -> np.ndarray:
    from matplotlib.image import imread
    png = tmp_path / f"{page.stem}.png"
    done = _offline([*browser, f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WIDTH},{height}",
                     f"--screenshot={png}", page.as_uri()], tmp_path)
    assert png.is_file(), f"no screenshot: rc {done.returncode}, {done.stderr[-2000:]}"
    return (imread(png)[:, :, :3] * 255).round().astype(np.uint8)        # [H, W, RGB]


def _crop(image: np.ndarray, box: list[float]) -> np.ndarray:
    left, top, width, height = (int(round(v)) for v in box)
    return image[top:top + height, left:left + width]


def _ink(crop: np.ndarray) -> float:
    """Fraction of pixels that are not the white background."""
    return float(np.mean(np.any(crop < 245, axis=-1)))


def _has_colour(crop: np.ndarray, rgb: tuple[int, int, int]) -> bool:
    return int(np.sum(np.all(np.abs(crop.astype(int) - rgb) <= 12, axis=-1))) >= 20


def test_plots_render_in_headless_chromium_offline(tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    report.write_text(render_html(mmlu_sweep(tmp_path)))
    check_renders(report, tmp_path)


@pytest.mark.skipif(not os.environ.get("EVALRUN_REPORT"), reason="EVALRUN_REPORT=<report.html> not set "
                    "(benchmarks/sweep_report.py sets it to check a real sweep's report)")
def test_a_given_report_renders_offline(tmp_path: Path) -> None:
    report = Path(os.environ["EVALRUN_REPORT"])
    assert_self_contained(report.read_text())
    check_renders(report, tmp_path)


def check_renders(report: Path, tmp_path: Path) -> None:
    """Every plot of `report` (all three: a sweep's report) is drawn in headless Chromium offline."""
    browser = _browser()
    _require_unshare(tmp_path)
    probe = _probe(browser, report, tmp_path)
    assert probe["fetches"] == 0, "the report fetched resources"
    assert sorted(probe["boxes"]) == sorted(PLOTS)
    for plot, (left, top, width, height) in probe["boxes"].items():
        assert width >= 200 and height >= 150 and left + width <= WIDTH, f"{plot}: box {width}x{height}"
    image = _screenshot(browser, report, probe["height"], tmp_path)
    assert image.shape[0] >= probe["height"] - 1 and image.shape[1] == WIDTH
    for plot, box in probe["boxes"].items():
        crop = _crop(image, box)
        colours = {tuple(px) for px in crop.reshape(-1, 3)[::7]}
        assert _ink(crop) > 0.03 and len(colours) >= 8, f"{plot} looks blank ({_ink(crop):.3f}, {len(colours)})"
        assert all(_has_colour(crop, rgb) for rgb in RUN_COLOURS[1:]), f"{plot}: candidate runs' colours missing"
    assert all(_has_colour(_crop(image, probe["boxes"][p]), RUN_COLOURS[0]) for p in ("plot-metric", "plot-bytes"))

    # the same crops of a page whose SVGs are emptied (same sizes) are blank: the check can fail
    blank = tmp_path / "blank.html"
    blank.write_text(re.sub(r"(<svg\b[^>]*>).*?</svg>", r"\1</svg>", report.read_text(), flags=re.DOTALL))
    empty = _screenshot(browser, blank, probe["height"], tmp_path)
    for plot, box in probe["boxes"].items():
        assert _ink(_crop(empty, box)) < 0.001, f"{plot}: the blank control is not blank"
