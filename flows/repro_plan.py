"""A ``flockfl repro`` run's plan (:func:`plan_repro`): the chosen budget, rows, columns and
``--set`` items of a table, its cells as the children of one sweep (every config validated
before anything runs) and its folder; and what is said before anything runs: how much it is
(:func:`count_line`) and the first dataset a cell needs and cannot find (:func:`missing_data`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from flows.repro_tables import Table, cell_label, has_cell, load_table, row_config


def as_overrides(mapping: Optional[dict]) -> list[str]:
    """A nested config mapping as ``--set`` items (values as YAML, so lists and null survive)."""
    from flockfl.config import flatten

    out = []
    for key, value in flatten(mapping or {}).items():
        text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
        out.append(f"{key}={text.removesuffix(chr(10) + '...')}")
    return out


def _pick(labels: dict, wanted: Optional[list[str]], what: str, table: str) -> list[str]:
    from flockfl.errors import ConfigError

    if not wanted:
        return list(labels)
    missing = [w for w in wanted if w not in labels]
    if missing:
        raise ConfigError(f"--{what} {', '.join(missing)}: not in table {table!r}; its {what}: {', '.join(labels)}")
    return [label for label in labels if label in wanted]


@dataclass
class ReproPlan:
    table: Table
    budget: str
    rows: list[str]
    cols: list[str]
    overrides: list[str]
    out: Path
    base_file: Path
    sweep: Any = None  # flows.sweep_plan.Plan

    def cells(self) -> list[tuple[str, str, list[str]]]:
        t = self.table
        budget = as_overrides(t.budgets[self.budget])
        return [(r, c, budget + as_overrides(t.columns[c]) + as_overrides(row_config(t.rows[r])) + self.overrides)
                for r in self.rows for c in self.cols if has_cell(t, r, c)]


def plan_repro(name: str, budget: Optional[str], seeds: Optional[list[int]], rows: Optional[list[str]],
               cols: Optional[list[str]], overrides: list[str], params: str, out: Optional[str] = None) -> ReproPlan:
    """Every cell × seed, validated before anything runs (a bad cell is a one-line ConfigError)."""
    from flockfl.errors import ConfigError
    from flows.sweep_plan import plan_sweep

    t = load_table(name)
    budget = budget or t.default_budget
    if budget not in t.budgets:
        raise ConfigError(f"--budget {budget!r}: table {name!r} has budgets {', '.join(t.budgets)}")
    picked_rows, picked_cols = _pick(t.rows, rows, "rows", name), _pick(t.columns, cols, "columns", name)
    tag = f"{name}-{budget}"
    if overrides:
        tag += "-" + hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:8]
    if picked_rows != list(t.rows) or picked_cols != list(t.columns):
        # a part of the table is its own sweep (its grid differs): its own folder, so the same
        # command continues it and neither the whole table's folder nor another part's refuses it
        part = json.dumps([picked_rows, picked_cols])
        tag += "-part-" + hashlib.sha256(part.encode()).hexdigest()[:8]
    folder = Path(out) if out else Path("runs") / "repro" / tag
    folder.mkdir(parents=True, exist_ok=True)
    base_file = folder / "base.yaml"
    base = {"name": f"repro-{name}", **t.base}
    text = yaml.safe_dump(base, sort_keys=False)
    if not base_file.exists() or base_file.read_text() != text:
        base_file.write_text(text)
    plan = ReproPlan(t, budget, picked_rows, picked_cols, list(overrides), folder, base_file)
    variants = [(cell_label(r, c), over) for r, c, over in plan.cells()]
    # the --set items shape the base (what the header describes) and win over every cell's own settings
    plan.sweep = plan_sweep(str(base_file), [], seeds or t.seeds, list(overrides), params, variants=variants)
    return plan


def count_line(plan: ReproPlan) -> str:
    """How much the table is: cells, seeds and runs at the chosen budget."""
    t = plan.table
    cells, runs = len(plan.cells()), len(plan.sweep.children)
    seeds = len(plan.sweep.seeds)
    default = " (the table's default)" if plan.budget == t.default_budget else ""
    others = [b for b in t.budgets if b != plan.budget]
    return (f"{cells} cell{'s' * (cells != 1)} × {seeds} seed{'s' * (seeds != 1)} = {runs} run{'s' * (runs != 1)} at "
            f"budget '{plan.budget}'{default}" + (f"; other budgets: {', '.join(others)} (--budget)" if others else "")
            + "; the time the table needs is printed when its first run is done")


def _data_problem(ds) -> Optional[str]:
    """Why a cell's dataset cannot be loaded (one line with the fix), or None. Only the files
    are looked for (the loader's own search: ``dataset.path``, ``data/raw/<name>/``, the Debian
    package's folder); generated and bundled datasets always load."""
    from flockfl.data.images import SYSTEM_DIRS, _find_idx_dir, default_mix_sources
    from flockfl.errors import ConfigError

    try:
        if ds.name in SYSTEM_DIRS:
            _find_idx_dir(ds.name, ds.path)
        elif ds.name == "mix":
            for source in ds.sources if ds.sources is not None else default_mix_sources(ds.path):
                if source in SYSTEM_DIRS:
                    _find_idx_dir(source, str(Path(ds.path) / source) if ds.path else None)
        elif ds.name == "npz" and not Path(ds.path or "").is_file():
            return f"npz: no file {ds.path!r}; set dataset.path (--set dataset.path=FILE.npz) to an existing .npz"
    except ConfigError as err:
        return str(err)
    return None


def missing_data(plan: ReproPlan) -> Optional[str]:
    """One line naming the first dataset a cell needs and cannot find, the cells that need it,
    and the fix; None when every cell's data is there."""
    needs: dict[str, list[str]] = {}
    problems: dict[str, str] = {}
    for child in plan.sweep.children:
        ds = child.cfg.dataset
        key = json.dumps(ds.model_dump(include={"name", "path", "sources"}), sort_keys=True)
        if key not in problems:
            problems[key] = _data_problem(ds)
        if problems[key]:
            needs.setdefault(key, [])
            if child.label not in needs[key]:
                needs[key].append(child.label)
    if not needs:
        return None
    key, cells = next(iter(needs.items()))
    return (f"table {plan.table.name!r} cannot start: {len(cells)} of its {len(plan.cells())} cells need data that is "
            f"missing ({problems[key]})")
