"""The import layers of DESIGN.md as a contract: an import that runs back up a layer, an
orchestrator or tracker import inside the library, or an import circle fails here, naming
the import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports is missing: pip install -e '.[test]'"
    res = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = res.stdout[res.stdout.find("Contracts"):] if "Contracts" in res.stdout else res.stdout + res.stderr
    assert res.returncode == 0, report


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the components with more than one module (the import circles)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def module_graph() -> dict[str, set[str]]:
    import grimp

    g = grimp.build_graph("flockfl", "flows", "tasks", "models")
    return {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}


def test_no_import_circles():
    circles = strongly_connected(module_graph())
    assert not circles, "import circles: " + "; ".join(" ↔ ".join(c) for c in circles)


def test_the_circle_check_can_fail():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
