"""A table of ``flockfl repro``: its file ``configs/repro/<name>.yaml`` (the keys are described in
flows/repro.py's docstring), loaded and checked (:func:`load_table`: a problem is one line naming
the file and the fix) into a :class:`Table`, and what its rows and columns make: the cells
(:func:`has_cell`, :func:`cell_label`), a row's own config (:func:`row_config`) and the
convention it is compared under (:func:`compared`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

TABLES_DIR = Path(__file__).resolve().parents[1] / "configs" / "repro"
KEYS = {"title", "paper", "notes", "base", "rows", "columns", "budgets", "default_budget", "seeds", "conventions",
        "published", "tolerance", "scale"}


@dataclass
class Table:
    name: str
    title: str
    paper: str
    base: dict
    rows: dict[str, dict]
    columns: dict[str, dict]
    budgets: dict[str, dict]
    default_budget: str
    seeds: list[int]
    conventions: list[dict]
    published: dict[str, dict]
    tolerance: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    scale: float = 100.0


def table_names() -> list[str]:
    return sorted(p.stem for p in TABLES_DIR.glob("*.yaml"))


def load_table(name: str) -> Table:
    """A table from configs/repro/, checked: a problem is one line naming the file and the fix."""
    from flockfl.errors import ConfigError
    from flockfl.experiments import read_mapping

    path = TABLES_DIR / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown table {name!r}; choose one of {', '.join(table_names())} (flockfl repro --list)")
    raw = read_mapping(path, "describing a table")
    unknown = set(raw) - KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(KEYS))}")
    for key in ("title", "paper", "base", "rows", "budgets"):
        if key not in raw:
            raise ConfigError(f"{path}: missing {key!r}")
    budgets = raw["budgets"]
    default = raw.get("default_budget", "paper")
    if default not in budgets:
        raise ConfigError(f"{path}: default_budget {default!r} is not one of the budgets ({', '.join(budgets)})")
    conventions = raw.get("conventions") or [{"label": "accuracy", "metric": "accuracy"}]
    t = Table(name=name, title=raw["title"], paper=raw["paper"], base=raw["base"], rows=dict(raw["rows"]),
              columns=dict(raw.get("columns") or {"": {}}), budgets=budgets, default_budget=default,
              seeds=list(raw.get("seeds") or [0, 1, 2]), conventions=conventions,
              published=raw.get("published") or {}, tolerance=raw.get("tolerance") or {},
              notes=list(raw.get("notes") or []), scale=float(raw.get("scale", 100.0)))
    labels = [c["label"] for c in t.conventions]
    for r, row in t.rows.items():
        if "compare" in row and row["compare"] not in labels:
            raise ConfigError(f"{path}: rows.{r}.compare is {row['compare']!r}, not a convention's label; "
                              f"choose one of: {'; '.join(labels)}")
        bad = set(row.get("only_columns") or ()) - set(t.columns)
        if bad:
            raise ConfigError(f"{path}: rows.{r}.only_columns names column(s) {', '.join(sorted(bad))} not in columns")
    for source, cells in t.published.items():
        for row, cols in cells.items():
            if row not in t.rows:
                raise ConfigError(f"{path}: published.{source} names row {row!r}, which is not in rows")
            bad = set(cols) - set(t.columns)
            if bad:
                raise ConfigError(f"{path}: published.{source}.{row} names column(s) {', '.join(sorted(bad))} not in columns")
    return t


def cell_label(row: str, col: str) -> str:
    return f"{row} | {col}" if col else row


ROW_KEYS = ("only_columns", "compare")  # a row's keys that are the table's, not the run's config


def row_config(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ROW_KEYS}


def compared(t: Table, row: str) -> str:
    """The convention whose value is compared with the published numbers in ``row``."""
    return t.rows[row].get("compare") or t.conventions[0]["label"]


def has_cell(t: Table, row: str, col: str) -> bool:
    only = t.rows[row].get("only_columns")
    return only is None or col in only
