"""Print a Comparison: a terminal table, markdown, csv or json (the HTML report is
evalrun/results/report_html.py). Every format carries the same numbers; csv has one line per
(group, run) with the run's header fields beside them."""
from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from typing import Any, Callable, Optional

from evalrun.results.compare import Comparison, GroupResult, RunHeader

FORMATS = ("table", "markdown", "csv", "json", "html")


def render(comparison: Comparison, fmt: str) -> str:
    if fmt == "html":
        from evalrun.results.report_html import render_html
        return render_html(comparison)
    renderers: dict[str, Callable[[Comparison], str]] = {
        "table": render_table, "markdown": render_markdown, "csv": render_csv, "json": render_json}
    if fmt not in renderers:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return renderers[fmt](comparison)


def render_json(c: Comparison) -> str:
    return json.dumps(c.to_dict(), indent=2) + "\n"


def render_csv(c: Comparison) -> str:
    heads = {h.label: h for h in c.runs}
    header_fields = ("model", "dtype", "cache_mode", "cache_window", "bytes_per_token", "wall_seconds",
                     "tokens_per_s", "dedup_ratio", "evalrun_version", "git_sha", "run_dir")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    fields = list(asdict(c.results[0]))
    writer.writerow(["task", "metric", "baseline", *fields, *header_fields])
    for r in c.results:
        row = asdict(r)
        writer.writerow([c.task, c.metric, c.baseline, *[_csv(row[f]) for f in fields],
                         *[_csv(getattr(heads[r.run], f)) for f in header_fields]])
    return out.getvalue()


def _csv(value: Any) -> Any:
    return "" if value is None or (isinstance(value, float) and value != value) else value


def describe(c: Comparison) -> str:
    """One line: what was compared and how."""
    test = ("exact McNemar test, exact paired interval" if c.method == "mcnemar-exact"
            else "paired bootstrap over problems")
    return (f"{c.task}: {c.metric} per {c.unit}, {c.shared_rows} shared rows; baseline {c.baseline}; "
            f"{c.level:.0%} intervals, {test}")


def coverage_notes(c: Comparison) -> list[str]:
    notes = [f"{h.label}: {h.left_out} scored rows not in every run, left out" for h in c.runs if h.left_out]
    notes += [f"{h.label}: {h.skipped} rows stored as skipped (prompt did not fit), left out"
              for h in c.runs if h.skipped]
    return notes


def header_cells(h: RunHeader) -> list[str]:
    return [h.label, h.model or "-", h.cache_mode or "-", _int(h.bytes_per_token), _num(h.wall_seconds, "{:.1f}"),
            _num(h.tokens_per_s, "{:.0f}"), _num(h.dedup_ratio, "x{:.2f}"),
            f"{h.evalrun_version or '-'}" + (f" ({h.git_sha})" if h.git_sha else "")]


HEADER_NAMES = ["run", "model", "cache", "bytes/token", "wall s", "tok/s", "dedup", "evalrun"]


def result_cells(c: Comparison, r: GroupResult) -> list[str]:
    base = r.delta is None
    return [r.group, r.run, str(r.n), f"{_num(r.metric, '{:.4f}')} ± {_num(r.stderr, '{:.4f}')}",
            "baseline" if base else _signed(r.delta),
            "" if base else f"[{_signed(r.ci_low)}, {_signed(r.ci_high)}]",
            "" if base else _p(r.p_value), "" if base or r.p_holm is None else _p(r.p_holm),
            "" if base else f"{r.to_correct}/{r.to_wrong}"]


def result_names(c: Comparison) -> list[str]:
    flips = "to right/wrong" if c.method == "mcnemar-exact" else "up/down"
    return ["group", "run", f"n ({c.unit}s)", f"{c.metric} ± se", "delta", f"{c.level:.0%} CI", "p", "p Holm", flips]


def render_table(c: Comparison) -> str:
    lines = [describe(c), ""]
    lines += _aligned(HEADER_NAMES, [header_cells(h) for h in c.runs])
    lines.append("")
    lines += _aligned(result_names(c), [result_cells(c, r) for r in c.results])
    notes = coverage_notes(c)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def render_markdown(c: Comparison) -> str:
    lines = [f"**{describe(c)}**", ""]
    lines += _md(HEADER_NAMES, [header_cells(h) for h in c.runs])
    lines.append("")
    lines += _md(result_names(c), [result_cells(c, r) for r in c.results])
    notes = coverage_notes(c)
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def _aligned(names: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(names, *rows)]
    fmt = lambda cells: "  ".join(f"{x:<{w}}" for x, w in zip(cells, widths)).rstrip()   # noqa: E731
    return [fmt(names), fmt(["-" * w for w in widths]), *[fmt(r) for r in rows]]


def _md(names: list[str], rows: list[list[str]]) -> list[str]:
    line = lambda cells: "| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |"   # noqa: E731
    return [line(names), "|" + "|".join("---" for _ in names) + "|", *[line(r) for r in rows]]


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
