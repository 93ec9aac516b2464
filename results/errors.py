"""Errors raised by the run-directory result store."""

from __future__ import annotations


class ResumeMismatchError(Exception):
    """The run dir was started with a different identity (model, tokenizer, data, config, keys)."""


class NotARunDirError(Exception):
    """The directory exists, is not empty and has no manifest.json: the store will not touch it."""


class RunDirBusyError(Exception):
    """Another open RunStore (in this or another process) holds the run dir's lock."""
