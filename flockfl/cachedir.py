"""Where flockfl keeps what it builds once per machine (compiled kernels, the engine probe's
verdicts, the empty MLflow schema), and how an environment variable turns such a thing off.
Standard library only: the command line reads it before torch or MLflow load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

OFF = ("off", "0", "false", "no")


def switched_off(value: Optional[str]) -> bool:
    """Whether an environment value says ``off`` (``off``, ``0``, ``false``, ``no``, any case)."""
    return (value or "").strip().lower() in OFF


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/flockfl`` (else ``~/.cache/flockfl``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flockfl"


def cache_file(env: str, name: str) -> Optional[Path]:
    """The file ``env`` names; None where it says off (:func:`switched_off`); else ``name`` in :func:`cache_dir`."""
    given = os.environ.get(env, "").strip()
    if switched_off(given):
        return None
    return Path(given) if given else cache_dir() / name
