"""The line budget (issue 34): no file under flockfl/, flows/, tasks/ or models/ over 400 lines.
Files allowed over it would be listed in OVER with their size when the budget was set (they
may shrink, never grow); since the split of flockfl/rounds.py none is."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 400
# still to split, with their size then (none since 2026-11-28)
OVER: dict[str, int] = {}


def test_no_file_over_the_line_budget_and_none_of_the_old_ones_grows():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for package in ("flockfl", "flows", "tasks", "models") for p in (ROOT / package).rglob("*.py")}
    new = {f: n for f, n in sizes.items() if n > BUDGET and f not in OVER}
    grown = {f: (OVER[f], sizes[f]) for f in OVER if sizes.get(f, 0) > OVER[f]}
    assert not new, f"files over {BUDGET} lines: {new}; split them along their jobs"
    assert not grown, f"files over the budget that grew (was, now): {grown}; split them rather than grow them"
