"""Where plugins come from, read without importing any of them: the entry points of the groups
:data:`GROUPS` (``flockfl.algorithms``, ``flockfl.models``, ``flockfl.datasets``,
``flockfl.schemes``: a contract) and the module names of ``FLOCKFL_PLUGINS`` (:data:`ENV`); and
:func:`_describe`, where a plugin's own code failed, in one line for its
:class:`~flockfl.plugins.PluginError`. :mod:`flockfl.plugins` loads and registers what these name.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Optional


ENV = "FLOCKFL_PLUGINS"
# registry kind → entry-point group (a contract: installed plugins declare these)
GROUPS = {"algorithm": "flockfl.algorithms", "model": "flockfl.models", "dataset": "flockfl.datasets",
          "scheme": "flockfl.schemes"}


def env_modules(value: Optional[str] = None) -> list[str]:
    """The module names of ``FLOCKFL_PLUGINS`` (comma-separated; blanks ignored)."""
    value = os.environ.get(ENV, "") if value is None else value
    return [m.strip() for m in value.split(",") if m.strip()]


def _entry_points() -> list:
    from importlib.metadata import entry_points

    eps = entry_points()
    out, seen = [], set()
    for kind, group in GROUPS.items():
        for ep in eps.select(group=group):
            if (group, ep.name, ep.value) not in seen:  # one distribution found twice on sys.path
                seen.add((group, ep.name, ep.value))
                out.append(ep)
    return out


def _kind_of(group: str) -> str:
    return next(k for k, g in GROUPS.items() if g == group)


def _describe(err: BaseException) -> str:
    """``Type: message (file:line)``, one line: where the plugin's own code failed."""
    msg = str(err).splitlines()[0] if str(err) else ""
    where = ""
    if isinstance(err, SyntaxError) and err.filename:
        where = f"{Path(err.filename).name}:{err.lineno}"
        msg = err.msg
    else:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename]
        if frames:
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}"
    return f"{type(err).__name__}: {msg}" + (f" ({where})" if where else "")
