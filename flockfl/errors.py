"""flockfl's errors: one hierarchy, a leaf module everything may import.

Every :class:`FlockError` is a problem the user can fix; the CLI prints it as one line and
exits with code 2.
"""


class FlockError(Exception):
    """A user-facing, one-line error (the CLI exits with code 2)."""


class ConfigError(FlockError, ValueError):
    """A configuration error: the message names the key, the value and the fix."""


class CheckpointError(FlockError, RuntimeError):
    """A checkpoint that cannot be trusted (bad checksum, truncated, wrong format)."""


class ExecutorError(ConfigError):
    """An executor problem the user can fix (unreachable scheduler, a partition the workers
    cannot read)."""


class UserError(FlockError):
    """Any other error the user can fix (an unknown run, a missing file)."""


__all__ = ["CheckpointError", "ConfigError", "ExecutorError", "FlockError", "UserError"]
