"""`flockfl repro TABLE`: the tables of configs/repro/ load, every cell of every budget is a valid
experiment, published numbers name real rows and columns; a small table runs end to end through
the real CLI (Prefect, MLflow SQLite), prints ours beside the published numbers with the protocol
and budget named, logs the table to the MLflow parent run, and the same command continues it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import last_json, run_flock

from flockfl.errors import ConfigError
from flows import repro, repro_plan, repro_render, repro_tables

TABLES = ("niid_bench_fmnist", "thesis_label_skew", "flexcfl_synthetic", "subfedavg", "curriculum")


def test_the_issue_tables_are_listed():
    assert set(TABLES) <= set(repro_tables.table_names())


@pytest.mark.parametrize("name", repro_tables.table_names())
def test_every_cell_of_every_budget_validates(name, tmp_path):
    t = repro_tables.load_table(name)
    assert t.published and t.notes, f"{name}: a table prints published numbers and says where ours may differ"
    for budget in t.budgets:
        plan = repro_plan.plan_repro(name, budget, None, None, None, [], "params.yaml", str(tmp_path / budget))
        cells = {c.label for c in plan.sweep.children}
        expected = {repro_tables.cell_label(r, c) for r in t.rows for c in t.columns if repro_tables.has_cell(t, r, c)}
        assert cells == expected
        assert len(plan.sweep.children) == len(expected) * len(t.seeds)
        base = plan.sweep.base
        assert base.eval.test_set in ("proportional", "label_union")  # every table names its protocol


def test_published_cells_must_name_rows_and_columns(tmp_path, monkeypatch):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({
        "title": "t", "paper": "p", "base": {}, "rows": {"A": {}}, "columns": {"x": {}}, "budgets": {"paper": {}},
        "published": {"src": {"B": {"x": 1.0}}}}))
    monkeypatch.setattr(repro_tables, "TABLES_DIR", tmp_path)
    with pytest.raises(ConfigError, match="published.src names row 'B', which is not in rows"):
        repro_tables.load_table("bad")


def test_overrides_reach_the_base_and_win_over_cells(tmp_path):
    plan = repro_plan.plan_repro("niid_bench_fmnist", "cpu", [0], ["FedProx"], ["#C=2"], ["train.momentum=0.5",
                                 "partition.rho=30"], "params.yaml", str(tmp_path))
    assert plan.sweep.base.train.momentum == 0.5
    (child,) = plan.sweep.children
    assert child.cfg.partition.rho == 30 and child.cfg.train.rounds == 10 and child.cfg.algorithm.name == "fedprox"


def test_bad_table_row_and_budget_are_one_line_errors(tmp_path):
    for args, msg in ((["nope"], "unknown table 'nope'"), (["subfedavg", "--budget", "gpu"], "--budget 'gpu'"),
                      (["subfedavg", "--rows", "Nope", "--dry-run"], "--rows Nope: not in table 'subfedavg'")):
        res = run_flock(["repro", *args], tmp_path)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0], res.stderr


@pytest.mark.slow
def test_a_small_table_end_to_end_and_continued(tmp_path):
    args = ["repro", "niid_bench_fmnist", "--rows", "FedAvg", "FedProx", "--columns", "IID", "#C=2", "--seeds", "0",
            "--set", "dataset.name=digits", "--set", "model.name=mlp", "--set", "train.rounds=2",
            "--set", "train.local_epochs=1", "--set", "train.batch_size=16", "--set", "train.lr=0.1",
            "--no-progress", "--json"]
    res = run_flock(args, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = last_json(res.stdout)
    assert out["protocol"] == {"test_set": "proportional", "average": "samples", "report": "best", "last_k": 10,
                               "conventions": "cheap", "reuse": True}
    assert out["runs"] == 4 and not out["failed"]
    cell = next(c for c in out["cells"] if c["row"] == "FedAvg" and c["column"] == "#C=2")
    assert cell["published"]["Flower"] == [78.10, 2.51] and cell["published"]["NIID-Bench"] == [77.3, 4.9]
    ours = cell["ours"]["global model, best round"]["mean"]
    assert 20 < ours <= 100  # digits after 2 rounds at lr 0.1: well above chance, in percent
    assert out["within_tolerance"]["Flower"]["of"] == 4
    assert "(budget 'paper'; the paper's: 50 × 10)" in res.stdout and "protocol: test_set=proportional, average=samples, report=best" in res.stdout
    assert "applied to every cell: dataset.name=digits" in res.stdout
    assert "4 cells × 1 seed = 4 runs at budget 'paper' (the table's default)" in res.stdout
    # the estimate, after the first run (the whole stderr on failure: pytest would cut its middle)
    assert "repro: run 1/4 (FedAvg | IID seed=0) took " in res.stderr, "stderr was:\n" + res.stderr
    assert "at that pace the table needs about " in res.stderr and "more for the 3 runs left" in res.stderr, res.stderr
    table = Path(tmp_path, out["out"], "table.md").read_text()
    assert "| FedAvg |" in table and "89.23 ± 0.45" in table and "Where and why ours may differ" in table

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(out["parent_run_id"])
    assert run.data.tags["flockfl.repro.table"] == "niid_bench_fmnist"
    arts = {a.path for a in client.list_artifacts(out["parent_run_id"], "repro")}
    assert {"repro/table.md", "repro/table.json"} <= arts
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{out['parent_run_id']}'")
    assert len(children) == 4

    again = run_flock(args, tmp_path)  # the same command continues: nothing runs again
    assert again.returncode == 0, again.stderr[-2000:]
    assert "4 of 4 runs finished" in again.stderr and "repro: run" not in again.stderr  # nothing ran: no estimate
    assert json.loads(again.stdout.strip().splitlines()[-1])["cells"] == out["cells"]


def test_a_conventions_metric_comes_from_the_runs_metrics_under_its_report_mode():
    """summarise() reports every convention's accuracy per report mode in its metrics; a table
    column naming ``accuracy__proportional__samples`` reads it under the run's own report mode."""
    from flows.repro_render import first_metric, summary_metrics

    summary = {"metrics": {"accuracy": 0.9, "accuracy__proportional__samples__final": 0.7,
                           "accuracy__proportional__samples__best": 0.8,
                           "accuracy__label_union__clients__final": 0.6}, "protocol": {"report": "best"}}
    m = summary_metrics(summary)
    assert first_metric(m, "accuracy__proportional__samples") == 0.8
    assert first_metric(m, "accuracy__label_union__clients") is None  # no 'best' reported for it
    assert first_metric(m, "accuracy") == 0.9


def test_a_part_of_a_table_has_its_own_folder_and_continues_there(tmp_path, monkeypatch):
    """--rows/--columns pick a part of the table, a sweep of its own grid: it gets its own default
    folder (the whole table's folder would refuse it as another sweep), the same part twice gets
    the same folder, and the whole table keeps its folder."""
    monkeypatch.chdir(tmp_path)
    plan = lambda rows, cols: repro_plan.plan_repro("pfllib_fmnist", "cpu", [0], rows, cols, [], "params.yaml")  # noqa: E731
    whole = plan(None, None).out
    part = plan(["Ditto"], ["pathological"]).out
    other = plan(["Ditto"], ["Dir(0.1)"]).out
    assert whole == Path("runs/repro/pfllib_fmnist-cpu")
    assert part.name.startswith("pfllib_fmnist-cpu-part-") and len({whole, part, other}) == 3
    assert plan(["Ditto"], ["pathological"]).out == part
    assert plan(list(repro_tables.load_table("pfllib_fmnist").rows), None).out == whole  # every row = the whole table


# ---------------------------------------------------------------------- before it runs: size, data, time


def _tiny_table(tmp_path, monkeypatch, dataset: dict, budgets=None) -> None:
    """configs/repro/tiny.yaml in a temp TABLES_DIR: 2 rows × 2 columns, one of which only one row
    takes (3 cells), 2 seeds."""
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "tiny.yaml").write_text(yaml.safe_dump({
        "title": "tiny", "paper": "p", "notes": ["n"], "seeds": [0, 1],
        "base": {"dataset": dataset, "partition": {"scheme": "iid", "num_clients": 4}, "model": {"name": "mclr"},
                 "train": {"rounds": 1, "clients_per_round": 2}, "tracking": {"enabled": False}},
        "rows": {"FedAvg": {"algorithm": {"name": "fedavg"}},
                 "FedProx": {"algorithm": {"name": "fedprox"}, "only_columns": ["a"]}},
        "columns": {"a": {"partition": {"num_clients": 4}}, "b": {"partition": {"num_clients": 2}}},
        "budgets": budgets or {"paper": {}, "cpu": {"train": {"rounds": 1}}},
        "published": {"src": {"FedAvg": {"a": 1.0}}}}))
    monkeypatch.setattr(repro_tables, "TABLES_DIR", tables)
    monkeypatch.chdir(tmp_path)


def test_the_count_line_names_cells_seeds_runs_and_budget(tmp_path, monkeypatch):
    _tiny_table(tmp_path, monkeypatch, {"name": "digits"})
    plan = repro_plan.plan_repro("tiny", None, None, None, None, [], "params.yaml")
    assert repro_plan.count_line(plan).startswith("3 cells × 2 seeds = 6 runs at budget 'paper' (the table's default); "
                                                  "other budgets: cpu (--budget)")
    one = repro_plan.plan_repro("tiny", "cpu", [0], ["FedAvg"], ["a"], [], "params.yaml")
    assert repro_plan.count_line(one).startswith("1 cell × 1 seed = 1 run at budget 'cpu'; other budgets: paper")
    assert repro_plan.missing_data(plan) is None  # digits is bundled


def test_the_estimate_after_the_first_run(tmp_path, monkeypatch):
    _tiny_table(tmp_path, monkeypatch, {"name": "digits"})
    plan = repro_plan.plan_repro("tiny", None, None, None, None, [], "params.yaml")
    first = plan.sweep.children[0]
    first.summary = {"sweep_wall_s": 42.0}
    line = repro.estimate_line(plan, first, done=1, left=5)
    assert line.startswith("repro: run 1/6 (FedAvg | a seed=0) took 42 s; at that pace the table needs about "
                           "4 min at budget 'paper', 4 min more for the 5 runs left")
    first.summary = {"sweep_wall_s": 3600.0}  # an hour a run, 3 at a time: 6 runs = 2 h, 5 left = 100 min
    assert "needs about 2.0 h at budget 'paper', 100 min more for the 5 runs left (3 at a time)" in \
        repro.estimate_line(plan, first, done=1, left=5, parallel=3)
    assert repro._duration(3 * 86400) == "3.0 days"


def test_missing_data_is_one_line_naming_it_and_the_fix(tmp_path, monkeypatch):
    """A table whose dataset is not where the loader looks: the check names the dataset, the
    places searched and the apt-get command; an npz path that does not exist names the path."""
    from flockfl.data import images

    monkeypatch.setitem(images.SYSTEM_DIRS, "fashion_mnist", str(tmp_path / "no-such-dir"))
    _tiny_table(tmp_path, monkeypatch, {"name": "fashion_mnist", "path": str(tmp_path / "nowhere")})
    plan = repro_plan.plan_repro("tiny", None, [0], None, None, [], "params.yaml")
    msg = repro_plan.missing_data(plan)
    assert msg and "\n" not in msg
    assert msg.startswith("table 'tiny' cannot start: 3 of its 3 cells need data that is missing (fashion_mnist: IDX "
                          "files not found in ")
    assert str(tmp_path / "nowhere") in msg and "apt-get update && apt-get install -y dataset-fashion-mnist" in msg
    npz = repro_plan.plan_repro("tiny", None, [0], ["FedAvg"], None, ["dataset.name=npz", "dataset.path=nope.npz"],
                                "params.yaml")
    assert repro_plan.missing_data(npz) == ("table 'tiny' cannot start: 2 of its 2 cells need data that is missing (npz: "
                                            "no file 'nope.npz'; set dataset.path (--set dataset.path=FILE.npz) to an "
                                            "existing .npz)")


def test_the_cli_refuses_a_table_without_its_data_and_dry_run_says_so(tmp_path):
    """Through the real command: a missing dataset is exit 2 and one line, before any run;
    --dry-run prints the count and the data's state and exits 0."""
    args = ["repro", "niid_bench_fmnist", "--rows", "FedAvg", "--columns", "IID", "--seeds", "0",
            "--set", "dataset.name=npz", "--set", "dataset.path=missing/data.npz"]
    dry = run_flock([*args, "--dry-run"], tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "1 cell × 1 seed = 1 run at budget 'paper' (the table's default)" in dry.stdout
    assert "data: table 'niid_bench_fmnist' cannot start: 1 of its 1 cells need data that is missing (npz: no file " \
           "'missing/data.npz'" in dry.stdout
    res = run_flock(args, tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot start" in lines[0] and "missing/data.npz" in lines[0], res.stderr
    assert not (tmp_path / "runs" / "repro").exists() or not list((tmp_path / "runs" / "repro").rglob("sweep.json"))


def test_a_row_compared_under_its_own_convention(tmp_path, monkeypatch):
    """A row's ``compare`` (the thesis's code measures CFL's cluster model as served) picks the
    convention counted against the published number; the compared value is marked ``*``; a
    label that is no convention is a one-line error."""
    _tiny_table(tmp_path, monkeypatch, {"name": "digits"})
    raw = yaml.safe_load((repro_tables.TABLES_DIR / "tiny.yaml").read_text())
    raw["conventions"] = [{"label": "after local training", "metric": "accuracy_finetuned"},
                          {"label": "as served", "metric": "accuracy"}]
    raw["published"] = {"src": {"FedAvg": {"a": 50.0}, "FedProx": {"a": 90.0}}}
    raw["tolerance"] = {"src": 2}
    raw["rows"]["FedProx"]["compare"] = "as served"
    (repro_tables.TABLES_DIR / "tiny.yaml").write_text(yaml.safe_dump(raw))
    plan = repro_plan.plan_repro("tiny", "cpu", [0], None, ["a"], [], "params.yaml")
    assert all("compare" not in " ".join(c.overrides) for c in plan.sweep.children)  # the table's key, not the run's
    for child in plan.sweep.children:  # both rows: 90 % as served, 50 % after local training
        child.status, child.summary = "finished", {"metrics": {"accuracy": 0.9, "accuracy_finetuned": 0.5}}
    text, data = repro_render.render(plan)
    cells = {c["row"]: c for c in data["cells"]}
    assert cells["FedAvg"]["compared"] == "after local training" and cells["FedProx"]["compared"] == "as served"
    assert data["within_tolerance"]["src"] == {"within": 2, "of": 2, "points": 2.0}
    assert "| FedAvg | 50.00* | 90.00 |" in text and "| FedProx | 50.00 | 90.00* |" in text
    raw["rows"]["FedProx"]["compare"] = "served"
    (repro_tables.TABLES_DIR / "tiny.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="rows.FedProx.compare is 'served', not a convention's label; choose one of: "
                                          "after local training; as served"):
        repro_tables.load_table("tiny")
