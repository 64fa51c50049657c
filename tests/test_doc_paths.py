"""Every repository path that a docstring or comment of the package names exists (a file moved
in a restructure left seven docstrings pointing at nothing; issue 34)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flockfl", "flows", "tasks", "models")
PATH = re.compile(r"(?<![\w/.-])((?:flockfl|flows|tasks|models|docs|benchmarks|configs|tests)/[\w./-]*\w)")
# paths in other projects' repositories, named with the project beside them
ELSEWHERE = {"benchmarks/model/pytorch/cnn.py"}  # pfl-research's simple_cnn (models/__init__.py)


def named_paths() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            for match in PATH.finditer(file.read_text()):
                found.setdefault(match.group(1), []).append(str(file.relative_to(ROOT)))
    return found


def test_every_path_named_in_the_code_exists():
    found = named_paths()
    assert len(found) > 20  # the scan sees the package's references (docs/config.md, flows/cli.py, ...)
    missing = {p: files for p, files in found.items()
               if p not in ELSEWHERE and not (ROOT / p).exists() and not (ROOT / f"{p}.py").exists()}
    assert not missing, "paths named in the code that do not exist: " + "; ".join(
        f"{p} (in {', '.join(sorted(set(files)))})" for p, files in sorted(missing.items()))
