"""The HTML report of a Comparison (`evalrun compare --format html`): one self-contained file
that opens offline. Plots are matplotlib figures inlined as SVG (text drawn as paths, so no
fonts are fetched); the same numbers follow as tables. The page has no script and no link.

    Comparison ──► #plot-metric   each run's overall metric ± stderr
               ──► #plot-deltas   forest plot: per group (and overall), each candidate's delta
                                  against the baseline with its interval; a line at 0
               ──► #plot-bytes    cache-mode sweeps only: metric against KV-cache bytes per token
               ──► run headers table, results table, coverage notes

NOTE: the output is byte-identical for the same input (fixed svg.hashsalt, no SVG date).
Run names and groups come from run directories: escaped in the tables (compare_cells), and in
the plots by `_plot_text` (no control character, no `$` that matplotlib would parse as maths).
"""
from __future__ import annotations

import html
import io
import math
import re
from typing import Optional, Sequence

from typing import TYPE_CHECKING

from evalrun.results.compare import OVERALL, Comparison, RunHeader

if TYPE_CHECKING:
    from matplotlib.figure import Figure
from evalrun.results.compare_cells import HEADER_NAMES, coverage_notes, describe, header_cells, result_cells, result_names
from evalrun.results.text import terminal_safe

_SVG_RC = {"svg.hashsalt": "evalrun-report", "svg.fonttype": "path"}
_NO_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}
_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }
th { background: #f2f2f2; }
figure { margin: 0 0 1.5em; }
figure svg { max-width: 100%; height: auto; }
"""


def render_html(comparison: Comparison) -> str:
    """The whole report as one HTML document (no external resources, no script)."""
    c = comparison
    title = terminal_safe(f"evalrun compare: {c.task}")
    parts = [f"<h1>{_esc(title)}</h1>", f"<p>{_esc(describe(c))}</p>",
             "<h2>Runs</h2>", _table(HEADER_NAMES, [header_cells(h) for h in c.runs]),
             "<h2>Plots</h2>",
             _figure("plot-metric", f"Overall {c.metric} per run (± 1 standard error)", _metric_plot(c)),
             _figure("plot-deltas", f"Delta against the baseline {c.baseline}, {c.level:.0%} intervals",
                     _delta_plot(c))]
    if _is_sweep(c.runs):
        parts.append(_figure("plot-bytes", f"{c.metric} against KV-cache bytes per token", _bytes_plot(c)))
    parts += ["<h2>Results</h2>", _table(result_names(c), [result_cells(c, r) for r in c.results])]
    notes = coverage_notes(c)
    if notes:
        parts.append("<ul>" + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{_esc(title)}</title>\n'
            f"<style>{_STYLE}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


# ------------------------------------------------------------------------------ plots

def _new_figure(figsize: tuple[float, float]) -> Figure:
    # NOTE: matplotlib loads here, with the first plot: 0.45 s that only `--format html` pays
    from matplotlib.figure import Figure
    return Figure(figsize=figsize, layout="constrained")


def _metric_plot(c: Comparison) -> Figure:
    runs = [h.label for h in c.runs]
    overall = [c.result(OVERALL, label) for label in runs]
    fig = _new_figure((max(4.0, 1.2 * len(runs) + 2), 3.2))
    ax = fig.add_subplot()
    ax.bar(range(len(runs)), [r.metric for r in overall], yerr=[_err(r.stderr) for r in overall],
           color=[_colour(i) for i in range(len(runs))], capsize=4)
    tilt = len(runs) > 3
    ax.set_xticks(range(len(runs)), [_plot_text(r) for r in runs], rotation=20 if tilt else 0,
                  ha="right" if tilt else "center")
    ax.set_ylabel(c.metric)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _delta_plot(c: Comparison) -> Optional[Figure]:
    candidates = [(i, h.label) for i, h in enumerate(c.runs) if h.label != c.baseline]
    if not candidates:
        return None
    groups = c.group_names()
    fig = _new_figure((7.0, 1.4 + 0.35 * len(groups) * max(1, len(candidates) / 2)))
    ax = fig.add_subplot()
    step = 0.6 / len(candidates)
    for k, (i, label) in enumerate(candidates):
        rows = [c.result(g, label) for g in groups]
        offset = ((len(candidates) - 1) / 2 - k) * step                  # the first candidate on top
        ys = [len(groups) - 1 - g + offset for g in range(len(groups))]
        deltas = [_nan(r.delta) for r in rows]
        below = [_err(_nan(r.delta) - _nan(r.ci_low)) for r in rows]
        above = [_err(_nan(r.ci_high) - _nan(r.delta)) for r in rows]
        ax.errorbar(deltas, ys, xerr=[below, above], fmt="o", color=_colour(i), capsize=3,
                    label=_plot_text(label))
    ax.axvline(0.0, color="#444", linewidth=1)
    if len(groups) > 1:
        ax.axhline(0.5, color="#999", linewidth=0.8, linestyle="--")        # groups above, overall below
    ax.set_yticks(range(len(groups)), [_plot_text(g) for g in reversed(groups)])
    ax.set_ylim(-0.6, len(groups) - 0.4)
    ax.set_xlabel(_plot_text(f"delta in {c.metric} against {c.baseline}"))
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    return fig


def _bytes_plot(c: Comparison) -> Figure:
    from matplotlib.transforms import offset_copy
    fig = _new_figure((6.0, 3.6))
    ax = fig.add_subplot()
    seen: dict[tuple[int, float], list[str]] = {}           # runs at the same point (e.g. bf16 and fp16)
    for i, h in enumerate(c.runs):
        if h.bytes_per_token is None:
            continue
        r = c.result(OVERALL, h.label)
        same = seen.setdefault((h.bytes_per_token, r.metric), [])
        # coincident runs sit side by side, 7 points apart, so each run's marker stays visible
        shifted = offset_copy(ax.transData, fig=fig, x=7 * len(same), units="points")
        ax.errorbar([h.bytes_per_token], [r.metric], yerr=[_err(r.stderr)], fmt="o", color=_colour(i), capsize=3,
                    transform=shifted)
        same.append(h.cache_mode or "-")
        err = _err(r.stderr)
        ax.update_datalim([(h.bytes_per_token, r.metric - err), (h.bytes_per_token, r.metric + err)])
    ax.autoscale_view()                      # the shifted transform does not update the data limits itself
    for (x, y), modes in seen.items():
        ax.annotate(_plot_text(" = ".join(modes)), (x, y), xytext=(6 + 7 * (len(modes) - 1), 6),
                    textcoords="offset points")
    ax.set_xlabel("KV-cache bytes per token")
    ax.set_ylabel(c.metric)
    ax.margins(x=0.15, y=0.2)
    ax.grid(alpha=0.3)
    return fig


def _is_sweep(runs: Sequence[RunHeader]) -> bool:
    """Runs that differ by cache mode, each with its bytes per token."""
    return len({h.cache_mode for h in runs}) > 1 and all(h.bytes_per_token is not None for h in runs)


def _svg(fig: Figure, prefix: str) -> str:
    """The figure as inline SVG; ids prefixed so that several SVGs in one page never clash."""
    import matplotlib
    buf = io.StringIO()
    with matplotlib.rc_context(_SVG_RC):
        fig.savefig(buf, format="svg", metadata=_NO_METADATA)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]                                  # drop the XML declaration and doctype
    return re.sub(r'(\bid="|href="#|url\(#)', rf"\1{prefix}-", svg)


def _figure(plot_id: str, caption: str, fig: Optional[Figure]) -> str:
    content = _svg(fig, plot_id) if fig is not None else "<p>Only one run: nothing to compare against.</p>"
    return f'<figure id="{plot_id}">\n{content}\n<figcaption>{_esc(terminal_safe(caption))}</figcaption>\n</figure>'


def _plot_text(text: str) -> str:
    """A name drawn in a plot: escaped, and `$` literal (matplotlib parses "$...$" as mathtext)."""
    return terminal_safe(text, one_line=True).replace("$", r"\$")


def _colour(i: int) -> str:
    return f"C{i % 10}"


def _nan(value: Optional[float]) -> float:
    return math.nan if value is None else float(value)


def _err(value: float) -> float:
    """An error-bar length; NaN (n = 1, or no interval) draws no bar."""
    return 0.0 if not math.isfinite(value) else max(value, 0.0)


# ------------------------------------------------------------------------------ tables

def _table(names: list[str], rows: list[list[str]]) -> str:
    head = "<tr>" + "".join(f"<th>{_esc(n)}</th>" for n in names) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{_esc(x)}</td>" for x in row) + "</tr>\n" for row in rows)
    return f"<table>\n<thead>{head}</thead>\n<tbody>\n{body}</tbody>\n</table>"


def _esc(text: str) -> str:
    return html.escape(text, quote=True)

