"""Errors a user can cause. The CLI prints their message alone (no traceback) and exits 2."""


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
