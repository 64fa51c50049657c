"""flockfl's errors: one hierarchy, a leaf module everything may import.

Every :class:`FlockError` is a problem the user can fix; the CLI prints it as one line and
exits with code 2.
"""

import re


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


def did_you_mean(word: object, choices, prefix: str = "") -> str:
    """``" (did you mean 'lr'?)"`` for the closest of ``choices`` to a misspelt ``word`` (text
    to append to an error line), or ``""`` when nothing is close. ``prefix`` is put before
    the suggestion (``train.`` for a key)."""
    import difflib

    if not isinstance(word, str):
        return ""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    if not close:  # a different case or a missing separator: 'FedAvg', 'flisdc'
        squash = {re.sub(r"[^a-z0-9]", "", c.lower()): c for c in names}
        hit = squash.get(re.sub(r"[^a-z0-9]", "", word.lower()))
        close = [hit] if hit else []
    return f" (did you mean '{prefix}{close[0]}'?)" if close and close[0] != word else ""


__all__ = ["CheckpointError", "ConfigError", "ExecutorError", "FlockError", "UserError", "did_you_mean"]
