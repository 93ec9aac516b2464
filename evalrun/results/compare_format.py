"""Print a Comparison: a terminal table, markdown, csv or json (the HTML report is
evalrun/results/report_html.py). Every format carries the same numbers; csv has one line per
(group, run) with the run's header fields beside them. Text from run directories is escaped:
the table's and markdown's cells by compare_cells, csv's by `csv_safe` (no cell starts a
spreadsheet formula), json by json.dumps (control characters as \\uXXXX)."""
from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from typing import Any, Callable

from evalrun.results.compare import Comparison
from evalrun.results.compare_cells import HEADER_NAMES, coverage_notes, describe, header_cells, result_cells, result_names
from evalrun.results.report_html import render_html
from evalrun.results.text import csv_safe

FORMATS = ("table", "markdown", "csv", "json", "html")


def render(comparison: Comparison, fmt: str) -> str:
    if fmt == "html":
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
        writer.writerow([*[_csv(v) for v in (c.task, c.metric, c.baseline)], *[_csv(row[f]) for f in fields],
                         *[_csv(getattr(heads[r.run], f)) for f in header_fields]])
    return out.getvalue()


def _csv(value: Any) -> Any:
    return "" if value is None or (isinstance(value, float) and value != value) else csv_safe(value)


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
