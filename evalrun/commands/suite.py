"""`evalrun suite FILE.toml`: the tasks × models × cache modes a file lists, each into its own
run directory (all resumable), then one combined table, and with a [baseline] the regress gate.

    output_dir = "runs/nightly"                # root; run dirs are <output_dir>/<task>/<model>/<cache mode>/
    [defaults]                                 # CLI flags for every run (name = value, without --)
    [[tasks]]   name = a registered task ("mmlu", "humaneval", ...), plus that command's flags
    [[models]]  name = "...", path = "...", cache_modes = ["fp32", ...], plus flags
    [baseline]  model = "<a models.name>"  or  output_dir = "<an earlier suite's root>",
                max_drop = 1.0, alpha = 0.05

Each entry is the argv of the real `evalrun <task>` command: each task x model goes through the
same parser into the same RunConfig once, and each of its cache modes is that config with
dataclasses.replace (mode, run directory, the suite's --ray flags), through the same pipeline, so a
suite run and a hand-typed run of the same settings are the same run.
Everything is parsed and checked before anything is computed; models load once each.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from evalrun.commands.compare import (EXIT_REGRESSION, check_gate_args, compare_dirs, format_gate, gate,
                                      regress_comparison)
from evalrun.commands.parser import build_parser, ray_request, run_config
from evalrun.commands.task import one_run, prepare
from evalrun.errors import BadInput, as_bad_input
from evalrun.results.atomic import atomic_write_text
from evalrun.results.compare_format import render_csv, render_markdown, render_table
from evalrun.results.text import terminal_safe
from evalrun.run.config import RunConfig
from evalrun.run.pipeline import ModelLoader
from evalrun.scale.execute import execute
from evalrun.tasks.registry import runnable_specs, task_spec

try:
    import tomllib
except ModuleNotFoundError:                              # Python 3.10
    import tomli as tomllib                              # type: ignore[no-redef]

RESERVED = {"output_dir": "the suite decides each run's directory", "cache_mode": "use the model's cache_modes",
            "cache_modes": "cache_modes belongs to [[models]]", "model": "use [[models]] path",
            "overwrite": "a suite resumes its runs; delete a run directory to redo it",
            "shard": "a suite runs whole tasks; shard with evalrun <task> --shard and evalrun merge"}
SUMMARY_FILES = ("comparison.md", "comparison.csv", "comparison.json")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class SuiteEntry:
    task: str
    model: str                     # the [[models]] name
    cache_mode: str
    run_dir: Path
    argv: list[str]                # the `evalrun <task> ...` command this entry is


@dataclass(frozen=True)
class Baseline:
    model: Optional[str]           # compare every other model with this one, mode by mode
    output_dir: Optional[Path]     # or each run with the same run of an earlier suite
    max_drop: float = 1.0
    alpha: float = 0.05
    require_baseline: bool = False # a candidate without its baseline run is an error (exit 2), not "not gated"


@dataclass(frozen=True)
class Suite:
    path: Path
    output_dir: Path
    entries: list[SuiteEntry]
    baseline: Optional[Baseline]


# ------------------------------------------------------------------------------ reading the file

def load_suite(path: Path) -> Suite:
    data = _read_toml(path)
    where = str(path)
    _only(data, {"output_dir", "defaults", "tasks", "models", "baseline"}, where)
    root = Path(_str(data, "output_dir", where, required=True))
    defaults = _table(data.get("defaults", {}), f"{where} [defaults]")
    tasks = _tables(data, "tasks", where)
    models = _tables(data, "models", where)
    commands = [s.name for s in runnable_specs()]
    for i, t in enumerate(tasks):
        if t.get("name") not in commands:
            raise BadInput(f"{where} tasks[{i}]: name must be one of {', '.join(commands)}, got {t.get('name')!r}")
    names = [_str(m, "name", f"{where} models[{i}]", required=True) for i, m in enumerate(models)]
    for i, name in enumerate(names):
        if not _NAME.match(name):
            raise BadInput(f"{where} models[{i}]: name {name!r} must be letters, digits, '.', '_' or '-' "
                           "(it names the run directories)")
    if len(set(names)) != len(names):
        raise BadInput(f"{where}: two [[models]] share a name; each needs its own")
    if len({t['name'] for t in tasks}) != len(tasks):
        raise BadInput(f"{where}: a task is listed twice; list each task once")
    entries = []
    for m_i, model in enumerate(models):                    # model-major: each model loads once
        modes = model.get("cache_modes", ["auto"])
        if not isinstance(modes, list) or not modes or not all(isinstance(x, str) and _NAME.match(x) for x in modes):
            raise BadInput(f"{where} models[{m_i}]: cache_modes must be a non-empty list of mode names, "
                           f"one mode per item (e.g. [\"fp32\", \"q4\"]), got {modes!r}")
        if len(set(modes)) != len(modes):
            raise BadInput(f"{where} models[{m_i}]: a cache mode is listed twice")
        for task in tasks:
            for mode in modes:
                run_dir = root / task["name"] / names[m_i] / mode
                flags = {**defaults, **_without(task, "name"), **_without(model, "name", "path", "cache_modes")}
                argv = [task["name"], "--cache-mode", mode, "--output-dir", str(run_dir)]
                if model.get("path") is not None:
                    argv += ["--model", _str(model, "path", f"{where} models[{m_i}]")]
                entries.append(SuiteEntry(task["name"], names[m_i], mode, run_dir,
                                          argv + _flags(flags, f"{where} ({task['name']}, {names[m_i]})")))
    return Suite(path, root, entries, _baseline(data.get("baseline"), names, where))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise BadInput(f"suite file not found: {path}") from None
    except OSError as exc:
        raise BadInput(f"cannot read suite file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path} is not valid TOML: {exc}") from None


def _baseline(raw: Any, models: list[str], where: str) -> Optional[Baseline]:
    if raw is None:
        return None
    b = _table(raw, f"{where} [baseline]")
    _only(b, {"model", "output_dir", "max_drop", "alpha", "require_baseline"}, f"{where} [baseline]")
    model, out = b.get("model"), b.get("output_dir")
    if (model is None) == (out is None):
        raise BadInput(f"{where} [baseline]: give model = \"<a [[models]] name>\" or output_dir = \"<an earlier "
                       "suite's output_dir>\", one of them")
    if model is not None and model not in models:
        raise BadInput(f"{where} [baseline]: model {model!r} is not one of the [[models]] ({', '.join(models)})")
    if model is not None and len(models) < 2:
        raise BadInput(f"{where} [baseline]: model needs a second [[models]] entry to compare with it")
    try:
        max_drop, alpha = float(b.get("max_drop", 1.0)), float(b.get("alpha", 0.05))
    except (TypeError, ValueError):
        raise BadInput(f"{where} [baseline]: max_drop and alpha must be numbers") from None
    check_gate_args(max_drop, alpha)
    required = b.get("require_baseline", False)
    if not isinstance(required, bool):
        raise BadInput(f"{where} [baseline]: require_baseline must be true or false")
    return Baseline(model, Path(out) if out is not None else None, max_drop, alpha, required)


def _flags(flags: dict[str, Any], where: str) -> list[str]:
    out = []
    for key, value in flags.items():
        name = key.replace("-", "_")
        if name in RESERVED:
            raise BadInput(f"{where}: {key} cannot be set in a suite ({RESERVED[name]})")
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            continue
        elif isinstance(value, list):
            out += [flag, ",".join(str(v) for v in value)]
        elif isinstance(value, (str, int, float)):
            out += [flag, str(value)]
        else:
            raise BadInput(f"{where}: {key} = {value!r} is not a flag value (string, number, boolean or list)")
    return out


def _only(table: dict[str, Any], keys: set[str], where: str) -> None:
    unknown = sorted(set(table) - keys)
    if unknown:
        raise BadInput(f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(keys))}")


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadInput(f"{where} must be a table")
    return value


def _tables(data: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    value = data.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        raise BadInput(f"{where}: needs at least one [[{key}]] entry")
    return value


def _str(table: dict[str, Any], key: str, where: str, required: bool = False) -> str:
    value = table.get(key)
    if value is None and required:
        raise BadInput(f"{where}: {key} is required")
    if not isinstance(value, str) or not value:
        raise BadInput(f"{where}: {key} must be a non-empty string, got {value!r}")
    return value


def _without(table: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in table.items() if k not in keys}


# ------------------------------------------------------------------------------ running it

def run_suite(args: argparse.Namespace) -> int:
    suite = load_suite(Path(args.file))
    parser = build_parser(_RaisingParser)
    ray = ray_request(args)
    parsed: dict[tuple[str, str], RunConfig] = {}      # (task, model) -> its first entry's config
    prepared = []
    for entry in suite.entries:                   # every entry checked before anything runs
        argv = entry.argv + (["--no-progress"] if args.no_progress else [])
        where = f"{suite.path} ({entry.task}, {entry.model}, {entry.cache_mode})"
        try:
            if (entry.task, entry.model) not in parsed:      # the other cache modes: the same flags
                cfg = run_config(parser.parse_args(argv), argv)
                _check_entry(cfg, entry)
                parsed[(entry.task, entry.model)] = replace(cfg, ray=ray) if ray.enabled else cfg
            cfg = replace(parsed[(entry.task, entry.model)], argv=("suite", str(suite.path), "--", *argv))
            prepared.append(prepare(one_run(cfg, entry.cache_mode, entry.run_dir, f"{entry.model}.{entry.cache_mode}")))
        except Exception as exc:  # noqa: BLE001 - bad input gets the entry's name, the rest re-raises
            bad = exc if isinstance(exc, BadInput) else as_bad_input(exc)
            if bad is None:
                raise
            hint = (" (in a suite: delete that run directory to redo it, or give the suite another output_dir)"
                    if "holds another run" in str(bad) else "")
            raise BadInput(f"{where}: {bad}{hint}") from None
    loader = ModelLoader()
    n = len(prepared)
    for i, (entry, p) in enumerate(zip(suite.entries, prepared)):
        print(terminal_safe(f"\n=== suite {i + 1}/{n}: {entry.task}, {entry.model}, {entry.cache_mode} -> "
                            f"{entry.run_dir}"), file=sys.stderr, flush=True)
        p.run.progress_desc = terminal_safe(f"[{i + 1}/{n} {entry.task} {entry.model} {entry.cache_mode}]",
                                            one_line=True)      # tqdm's line
        status = execute(p, loader)
        if status:
            return status
    _write_tables(suite, [p.todo.keys for p in prepared])
    return _gate(suite) if suite.baseline else 0


def _check_entry(cfg: RunConfig, entry: SuiteEntry) -> None:
    """The suite decides these; a flag that reached them anyway (another spelling) is refused."""
    if cfg.output_dir != str(entry.run_dir) or cfg.cache_modes != (entry.cache_mode,):
        raise BadInput("an entry's flags may not set the output directory or the cache mode (the suite does)")
    if cfg.overwrite:
        raise BadInput("overwrite cannot be set in a suite")
    flag = task_spec(cfg.task).model_free(cfg.options)
    if flag is not None:
        raise BadInput(f"{flag.lstrip('-').replace('-', '_')} cannot be set in a suite (a suite generates)")


class _RaisingParser(argparse.ArgumentParser):
    """An entry's flags are checked by the real parser, whole names only; a complaint becomes a BadInput."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> Any:
        raise BadInput(message)


def _write_tables(suite: Suite, selections: list[list[tuple]]) -> None:
    """One comparison per task over all of its runs (on this suite's selection of questions),
    printed and written beside the runs."""
    markdown, csv_parts, records = [], [], []
    for task in dict.fromkeys(e.task for e in suite.entries):
        entries = [e for e in suite.entries if e.task == task]
        selection = {k for e, keys in zip(suite.entries, selections) if e.task == task for k in keys}
        base = 0
        if suite.baseline and suite.baseline.model:
            base = next(i for i, e in enumerate(entries) if e.model == suite.baseline.model)
        c = compare_dirs([str(e.run_dir) for e in entries], base, labels=[f"{e.model}/{e.cache_mode}" for e in entries],
                         selection=sorted(selection))
        print(terminal_safe(f"\n=== {task}\n" + render_table(c)), end="")
        markdown.append(f"## {task}\n\n" + render_markdown(c))
        csv_parts.append(render_csv(c) if not csv_parts else render_csv(c).split("\n", 1)[1])
        records.append(c.to_dict())
    suite.output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(suite.output_dir / "comparison.md", "\n".join(markdown))
    atomic_write_text(suite.output_dir / "comparison.csv", "".join(csv_parts))
    atomic_write_text(suite.output_dir / "comparison.json", json.dumps(records, indent=2) + "\n")
    print(terminal_safe(f"\ncombined table: {suite.output_dir / 'comparison.md'} (.csv, .json)"))


def gate_pairs(suite: Suite) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """(baseline run dir, candidate run dir) pairs the [baseline] section asks for, and the
    candidates that have no counterpart in the suite (model = ...: a mode the baseline model lacks)."""
    b = suite.baseline
    assert b is not None
    if b.model is not None:
        base = {(e.task, e.cache_mode): e.run_dir for e in suite.entries if e.model == b.model}
        others = [e for e in suite.entries if e.model != b.model]
        return ([(base[(e.task, e.cache_mode)], e.run_dir) for e in others if (e.task, e.cache_mode) in base],
                [e.run_dir for e in others if (e.task, e.cache_mode) not in base])
    assert b.output_dir is not None
    return [(b.output_dir / e.run_dir.relative_to(suite.output_dir), e.run_dir) for e in suite.entries], []


def _gate(suite: Suite) -> int:
    b = suite.baseline
    assert b is not None
    pairs, unmatched = gate_pairs(suite)
    missing = [cand for base, cand in pairs if not base.exists()] + unmatched
    if missing and b.require_baseline:
        raise BadInput(f"{suite.path} [baseline]: no baseline run for {', '.join(map(str, missing))} "
                       "(require_baseline = true)")
    failed = gated = 0
    for base, cand in pairs:
        print(terminal_safe(f"\n=== gate: {cand} against {base}"))
        if not base.exists():
            print(terminal_safe(f"no baseline run at {base}: NOT GATED"))
            continue
        result = gate(regress_comparison(str(base), str(cand)), b.max_drop, b.alpha)
        print(terminal_safe(format_gate(result, b.max_drop, b.alpha, str(base), str(cand))))
        failed += result.failed
        gated += 1
    for cand in unmatched:
        print(terminal_safe(f"\n=== gate: {cand}: the baseline model has no run of this task and cache mode: "
                            "NOT GATED"))
    total = len(pairs) + len(unmatched)
    if b.output_dir is not None and not b.output_dir.exists():
        print(terminal_safe(f"\nwarning: the baseline output_dir {b.output_dir} does not exist "
                            "(a first night, or a typo?)"))
    not_gated = f"; {total - gated} of {total} NOT GATED (no baseline run)" if gated < total else ""
    print(f"\nsuite gate: {failed} of {gated} gated runs regressed{not_gated}" if failed else
          f"\nsuite gate: no significant drop of {b.max_drop:g} points or more in {gated} gated runs{not_gated}")
    return EXIT_REGRESSION if failed else 0


def suite_entries(path: str | Path) -> Sequence[SuiteEntry]:
    """The runs a suite file describes (for scripts and tests)."""
    return load_suite(Path(path)).entries
