"""The cells of a Comparison's two tables (runs, then results per group) and its notes, as text:
what every format prints (evalrun/results/compare_format.py, evalrun/results/report_html.py).
Run names, groups and manifest fields come from run directories: every cell and note is
`terminal_safe` (evalrun/results/text.py)."""
from __future__ import annotations

from typing import Optional

from evalrun.results.compare import Comparison, GroupResult, RunHeader
from evalrun.results.text import terminal_safe


def describe(c: Comparison) -> str:
    """One line: what was compared and how."""
    test = ("exact McNemar test, exact paired interval" if c.method == "mcnemar-exact"
            else "paired bootstrap over problems")
    return terminal_safe(f"{c.task}: {c.metric} per {c.unit}, {c.shared_rows} shared rows; baseline {c.baseline}; "
                         f"{c.level:.0%} intervals, {test}")


def coverage_notes(c: Comparison) -> list[str]:
    notes = [f"{h.label}: {h.left_out} scored rows not in every run, left out" for h in c.runs if h.left_out]
    notes += [f"{h.label}: {h.skipped} rows stored as skipped (prompt did not fit), left out"
              for h in c.runs if h.skipped]
    return [terminal_safe(n) for n in notes]


def header_cells(h: RunHeader) -> list[str]:
    return [terminal_safe(x) for x in _header_cells(h)]


def _header_cells(h: RunHeader) -> list[str]:
    return [h.label, h.model or "-", h.cache_mode or "-", _int(h.bytes_per_token), _num(h.wall_seconds, "{:.1f}"),
            _num(h.tokens_per_s, "{:.0f}"), _num(h.dedup_ratio, "x{:.2f}"),
            f"{h.evalrun_version or '-'}" + (f" ({h.git_sha})" if h.git_sha else "")]


HEADER_NAMES = ["run", "model", "cache", "bytes/token", "wall s", "tok/s", "dedup", "evalrun"]


def result_cells(c: Comparison, r: GroupResult) -> list[str]:
    base = r.delta is None
    return [terminal_safe(r.group), terminal_safe(r.run), str(r.n),
            f"{_num(r.metric, '{:.4f}')} ± {_num(r.stderr, '{:.4f}')}",
            "baseline" if base else _signed(r.delta),
            "" if base else f"[{_signed(r.ci_low)}, {_signed(r.ci_high)}]",
            "" if base else _p(r.p_value), "" if base or r.p_holm is None else _p(r.p_holm),
            "" if base else f"{r.to_correct}/{r.to_wrong}"]


def result_names(c: Comparison) -> list[str]:
    flips = "to right/wrong" if c.method == "mcnemar-exact" else "up/down"
    return ["group", "run", f"n ({c.unit}s)", f"{c.metric} ± se", "delta", f"{c.level:.0%} CI", "p", "p Holm", flips]


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None or value != value else fmt.format(value)


def _int(value: Optional[int]) -> str:
    return "-" if value is None else f"{value:,}"


def _signed(value: Optional[float]) -> str:
    return "-" if value is None or value != value else f"{value:+.4f}"


def _p(value: Optional[float]) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.2e}" if value < 1e-3 else f"{value:.3f}"
