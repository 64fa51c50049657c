"""Where a run's code came from: the git commit, branch and dirty flag, as MLflow tags.

:func:`source_tags` reads them with one ``git status`` per work tree and process; a run is
tagged with them when it is created, and a resumed run that runs other code gets them beside
its first ones (flows/tracking/tracker.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

_SOURCE: dict[str, dict[str, str]] = {}


def _git_root(start: Path) -> Optional[Path]:
    for d in (start, *start.parents):
        if (d / ".git").exists():
            return d
    return None


def source_tags(folder: Optional[Path] = None) -> dict[str, str]:
    """``mlflow.source.git.commit`` (and ``.branch``) and ``flockfl.git_dirty`` ("true" when
    tracked files differ from that commit; untracked files do not count) of the git work tree
    holding ``folder``, by default the one holding flockfl's code, else the working directory's;
    {} outside git, without a git binary, or when git refuses the folder. One ``git status`` per
    work tree and process (the code a process runs is what it imported), without taking the
    index lock (others may be committing)."""
    import subprocess

    if folder is not None:
        root = _git_root(Path(folder).resolve())
    else:
        root = _git_root(Path(__file__).resolve().parent) or _git_root(Path.cwd().resolve())
    if root is None:
        return {}
    if str(root) in _SOURCE:
        return _SOURCE[str(root)]
    tags: dict[str, str] = {}
    try:
        res = subprocess.run(["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain=v2", "--branch",
                              "--untracked-files=no"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        res = None
    if res is not None and res.returncode == 0:
        head = {}
        dirty = False
        for line in res.stdout.splitlines():
            if line.startswith("# branch."):
                k, _, v = line[len("# branch."):].partition(" ")
                head[k] = v
            elif line.strip():
                dirty = True
        commit = head.get("oid", "")
        if len(commit) == 40:  # not "(initial)": a repository without a commit has nothing to name
            tags["mlflow.source.git.commit"] = commit
            if head.get("head") and head["head"] != "(detached)":
                tags["mlflow.source.git.branch"] = head["head"]
            tags["flockfl.git_dirty"] = "true" if dirty else "false"
    _SOURCE[str(root)] = tags
    return tags
