"""Errors raised by the run-directory result store."""

from __future__ import annotations


class ResumeMismatchError(Exception):
    """The run dir was started with a different identity (model, tokenizer, data, config, keys)."""


class NotARunDirError(Exception):
    """The directory exists, is not empty and has no manifest.json: the store will not touch it."""


class RunDirBusyError(Exception):
    """Another open RunStore (in this or another process) holds the run dir's lock."""


class RunReadError(Exception):
    """A run directory cannot be read as a finished run (missing, corrupt, torn or unfinished);
    the message starts with the directory."""


class CompareError(Exception):
    """Runs that cannot be compared (different tasks, no shared questions, bad options)."""
