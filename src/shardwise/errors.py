"""Errors a user can cause. The CLI prints their message alone (no traceback) and exits 2."""

import sys


class ShardwiseError(Exception):
    """Base class: the message names the offending value and the fix."""


class ConfigError(ShardwiseError):
    """A configuration value is unknown, of the wrong type, or inconsistent with another."""


class DataError(ShardwiseError):
    """A data set path is missing, empty, unreadable or of an unknown format."""


class NotYetSupportedError(ShardwiseError):
    """A valid request whose implementation has not landed yet."""


class CheckpointError(ShardwiseError):
    """A checkpoint is missing, invalid, or does not fit the model or run being resumed."""


class ReportedError(ShardwiseError):
    """Ranks failed with user errors (exit 2) whose messages they printed themselves: the
    CLI adds no line of its own; the exception still carries the whole text for the API."""


def print_error(exc: ShardwiseError) -> int:
    """Print a user error the CLI way, once, and return the exit status 2."""
    if not isinstance(exc, ReportedError):
        print(f"error: {exc}", file=sys.stderr)
    return 2
