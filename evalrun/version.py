"""The version of this evalrun, and the git commit of the checkout it runs from (if any).

A leaf module (standard library only) that any layer may import: `evalrun --version` prints
version_line() (evalrun/commands/cli.py), run manifests record git_info().
"""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from typing import Any, Optional

from evalrun import __version__


def source_checkout() -> Optional[Path]:
    """The root of the git checkout evalrun is imported from (None for an installed wheel)."""
    spec = importlib.util.find_spec("evalrun")  # locates, does not import
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).resolve().parent.parent
    return root if (root / ".git").exists() and (root / "pyproject.toml").is_file() else None


def git_info() -> Optional[dict[str, Any]]:
    """{"sha", "dirty"} of the checkout evalrun runs from, or None (a wheel, or no git)."""
    checkout = source_checkout()
    if checkout is None:
        return None

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        return {"sha": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "-uno"))}
    except (OSError, subprocess.SubprocessError):
        return None


def version_line() -> str:
    """'evalrun 0.1.0', plus '(git <sha>[ dirty], <checkout>)' where evalrun runs from a git checkout."""
    git = git_info()
    if git is None:
        return f"evalrun {__version__}"
    dirty = " dirty" if git["dirty"] else ""
    return f"evalrun {__version__} (git {git['sha'][:12]}{dirty}, {source_checkout()})"
