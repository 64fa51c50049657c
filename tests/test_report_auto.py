"""`flockfl report` and ``algorithm.*=auto``: the section "Thresholds and cluster counts chosen from
the data (auto)" (the latest decision per run and key, from each run's ``auto_choices.json``)
and the figure of the criterion's curves side by side. The decisions in the fast tests are made
by the real criterion (flockfl.clustering.choose); the end-to-end tests run a real `flockfl sweep`
of PACFL with ``algorithm.beta=auto`` into a real MLflow SQLite store and the real `flockfl report`."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import run_flock

HEADING = "Thresholds and cluster counts chosen from the data (auto)"


# ---------------------------------------------------------------------- real decisions, no MLflow (fast)


def _blobs(groups: int, per: int, seed: int) -> np.ndarray:
    """Euclidean distances between ``groups`` tight, well separated blobs of ``per`` points."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(10.0 * g, 0.5, size=(per, 2)) for g in range(groups)])
    return np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))


def _decision(groups: int, key: str, algorithm: str, round: int, seed: int = 0, **extra) -> dict:
    from flockfl.clustering.choose import choose_cut

    return choose_cut(_blobs(groups, 5, seed), "average").record(key, algorithm, round, **extra)


def _summary(name: str, decisions: list[dict], params: dict | None = None, note: str = ""):
    from flows.render import RunSummary

    return RunSummary(run_id=name * 4, name=name, status="FINISHED", group=name, seed="0",
                      final={"accuracy": 0.5, "round": 3}, history={"accuracy": {1: 0.4, 2: 0.5, 3: 0.5}},
                      params=params or {}, auto_choices=decisions, auto_note=note)


@pytest.fixture(scope="module")
def decided():
    """Three runs: PACFL deciding β once before round 0 (three groups); FedAC deciding k each
    round (two groups, then three) beside a CFL split test with its extras; FedAvg, no auto key."""
    pacfl = _decision(3, "algorithm.beta", "pacfl", -1, unit="degrees")
    fedac = [_decision(2, "algorithm.k", "fedac", 0), _decision(2, "algorithm.k", "fedac", 1, seed=1),
             _decision(3, "algorithm.k", "fedac", 2, seed=2)]
    cfl = _decision(2, "algorithm.eps1", "cfl", 2, cluster=0, members=10, confirmed=True)
    assert (pacfl["k"], fedac[-1]["k"], cfl["k"]) == (3, 3, 2)  # the criterion found the blobs
    return [_summary("pacfl-auto", [pacfl]), _summary("mixed-auto", [*fedac, cfl]), _summary("fedavg", [])]


def test_the_table_has_the_latest_decision_per_run_and_key(decided):
    from flows.render import auto_table

    header, rows = auto_table(decided)
    assert header == ["run", "algorithm", "key", "decided", "chosen k", "value", "score", "margin", "decisions", "why"]
    by = {(r[0], r[2]): dict(zip(header, r)) for r in rows}
    assert sorted(by) == [("mixed-auto", "algorithm.eps1"), ("mixed-auto", "algorithm.k"),
                          ("pacfl-auto", "algorithm.beta")]  # fedavg chose nothing: no row
    pacfl = decided[0].auto_choices[0]
    row = by[("pacfl-auto", "algorithm.beta")]
    assert row["decided"] == "before round 0" and row["chosen k"] == "3" and row["decisions"] == "1"
    assert row["value"] == f"{pacfl['value']:.4g} degrees" and row["algorithm"] == "pacfl"
    assert row["score"] == f"{pacfl['score']:.3f}" and row["margin"] == f"{pacfl['margin']:.3f}"
    assert row["why"] == pacfl["reason"]
    fedac = by[("mixed-auto", "algorithm.k")]  # three decisions; the table shows round 2's, k=3
    assert fedac["decided"] == "round 2" and fedac["chosen k"] == "3" and fedac["decisions"] == "3"
    assert fedac["margin"] == f"{decided[1].auto_choices[2]['margin']:.3f}"
    cfl = by[("mixed-auto", "algorithm.eps1")]
    assert cfl["chosen k"] == "2" and cfl["why"].endswith("; cluster=0, members=10, confirmed=True")


def test_one_cluster_and_no_candidates_are_shown_as_such():
    from flockfl.clustering.choose import choose_cut
    from flows.render import auto_table

    rng = np.random.default_rng(0)
    flat = choose_cut(np.abs(rng.normal(1.0, 0.05, (12, 12))), "average").record("algorithm.beta", "pacfl", -1)
    few = choose_cut(np.ones((2, 2)) - np.eye(2), "average").record("algorithm.beta", "pacfl", -1)
    assert flat["k"] == 1 and flat["value"] is None and flat["score"] is not None and few["curve"] == []
    _, rows = auto_table([_summary("flat", [flat]), _summary("few", [few])])
    assert rows[0][4:8] == ["1", "", f"{flat['score']:.3f}", f"{flat['margin']:.3f}"]  # no threshold: a cut above all
    assert rows[1][4:8] == ["1", "", "", ""] and "too few to compare" in rows[1][9]


def test_the_curves_show_the_silhouette_the_floor_and_the_chosen_k(monkeypatch, tmp_path, decided):
    from flockfl import plots
    from flows.render import auto_latest
    from flows.render_figures import auto_curves

    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)
    panels = [(r.name, rec, n) for r in decided for rec, n in auto_latest(r)]
    auto_curves(panels, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    axes = [ax for ax in figs[0].axes if ax.lines]
    assert len(axes) == 3 and all(axes[0].get_shared_y_axes().joined(axes[0], ax) for ax in axes)
    for ax, (name, rec, n) in zip(axes, panels):
        lines = {ln.get_label(): ln for ln in ax.lines}
        silhouette = lines["mean silhouette"]
        np.testing.assert_allclose(silhouette.get_xdata(), [c["k"] for c in rec["curve"]])
        np.testing.assert_allclose(silhouette.get_ydata(), [c["score"] for c in rec["curve"]])
        np.testing.assert_allclose(lines["no structure ≤ 0.25"].get_ydata(), [0.25, 0.25])  # the floor
        np.testing.assert_allclose(lines[f"chosen k = {rec['k']}"].get_xdata(), [rec["k"], rec["k"]])
        title = ax.get_title()
        assert name in title and f"k = {rec['k']}, margin {rec['margin']:.3f}" in title
        assert ("latest of 3" in title) == (n == 3)


def test_the_section_is_there_only_when_some_run_has_auto_keys(decided, tmp_path):
    from flows.render_documents import _sections, render_html, render_markdown
    from flows.render_figures import draw_figures

    figures = draw_figures(decided, tmp_path)
    md = render_markdown(_sections("t", [], decided, figures))
    assert f"## {HEADING}" in md and "![auto_choice_curves.png](auto_choice_curves.png)" in md
    section = md.split(f"## {HEADING}")[1].split("\n## ")[0]
    assert "| pacfl-auto | pacfl | algorithm.beta | before round 0 | 3 |" in section and "| fedavg |" not in section
    html = render_html(_sections("t", [], decided, figures), tmp_path)
    assert f"<h2>{HEADING}</h2>" in html and html.count("data:image/png;base64,") == 2  # accuracy per round, the curves
    plain = [decided[2]]
    (tmp_path / "plain").mkdir()
    figures = draw_figures(plain, tmp_path / "plain")
    assert "auto_choice_curves.png" not in figures
    assert HEADING not in render_markdown(_sections("t", [], plain, figures))
    # a run that should have evidence and has none: the section says why, no table, no figure
    lost = [_summary("lost", [], {"algorithm.beta": "auto"}, "algorithm.beta=auto, but no auto_choices.json artifact")]
    (tmp_path / "lost").mkdir()
    md = render_markdown(_sections("t", [], lost, draw_figures(lost, tmp_path / "lost")))
    assert f"## {HEADING}" in md and "_No auto evidence: lost: algorithm.beta=auto, but no" in md
    assert "| decided |" not in md and "auto_choice_curves" not in md


# ---------------------------------------------------------------------- end to end: flockfl sweep → flockfl report


SWEEP = ["--set", "algorithm.name=pacfl", "--set", "algorithm.beta=auto", "--set", "model.hidden=32",
         "--set", "partition.scheme=sc_niid", "--set", "partition.rho=100", "--set", "partition.num_clients=15",
         "--set", "train.rounds=1", "--set", "train.clients_per_round=5", "--set", "train.local_epochs=1",
         # two runs choose β themselves (2 and 3 true groups), two have a fixed β and choose nothing
         "--grid", "partition.sc_clusters=2,3", "--grid", "algorithm.beta=auto,25"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real `flockfl sweep` of PACFL (four child runs) into a SQLite store in a temp folder."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("report_auto")
    (root / "params.yaml").write_text((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    uri = f"sqlite:///{root}/mlflow.db"
    res = run_flock(["sweep", "digits_dirichlet", "--json", "--no-progress", "--name", "auto-sweep", "--sweep-dir",
                     str(root / "sweep"), "--tracking-uri", uri, *SWEEP], root, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    client = MlflowClient(uri)
    runs = {c["label"]: client.get_run(c["run_id"]) for c in summary["children"].values()}
    assert len(runs) == 4 and all(c["status"] == "finished" for c in summary["children"].values())
    return {"root": root, "uri": uri, "client": client, "parent": summary["parent_run_id"], "runs": runs}


@pytest.fixture(scope="module")
def report(sweep):
    """`flockfl report <sweep dir> --html` through the real `flockfl` process (logged to the parent)."""
    res = run_flock(["report", str(sweep["root"] / "sweep"), "--html", "--tracking-uri", sweep["uri"]], sweep["root"])
    return res, sweep["root"] / "runs" / "reports" / f"auto-sweep-{sweep['parent'][:8]}"


def _auto_rows(text: str) -> dict[str, dict[str, str]]:
    """The auto section's table (after its heading, up to the next blank line), by run name."""
    block = text.split(HEADING, 1)[1]
    lines = [ln for ln in block.split("\n\n") if ln.startswith("| run |")][0].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split(" | ")]
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split(" | ")))) for ln in lines[2:]]
    return {r["run"]: r for r in rows}


def _not_blank(png: Path, panels: int) -> None:
    """A real figure of ``panels`` panels side by side: wide, real contrast, many colours, and the
    curve (tab:blue), the chosen k (tab:green) and the floor (grey) drawn in solid pixels."""
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    img = imread(png)[..., :3]
    px = (img * 255).round().astype(int)
    colours = len(np.unique(px.reshape(-1, 3), axis=0))
    assert img.shape[1] > 0.8 * panels * img.shape[0], img.shape  # the panels side by side
    assert img.std() > 0.05 and colours > 100, (img.std(), colours)
    for colour, least in (("tab:blue", 300 * panels), ("tab:green", 300 * panels), ("grey", 100 * panels)):
        rgb = (np.array(to_rgb(colour)) * 255).round().astype(int)
        assert (np.abs(px - rgb).sum(-1) == 0).sum() > least, colour


@pytest.mark.slow
def test_report_shows_the_chosen_k_and_margin_of_every_auto_run(sweep, report):
    res, out = report
    assert res.returncode == 0, res.stderr
    assert not res.stderr.strip(), res.stderr
    md = (out / "report.md").read_text()
    assert md.count(f"## {HEADING}") == 1
    rows, printed = _auto_rows(md), _auto_rows(res.stdout)  # the same table on stdout
    assert rows == printed
    auto = {label: run for label, run in sweep["runs"].items() if "beta=auto" in label}
    assert len(auto) == 2 and len(rows) == 2  # the fixed-β runs chose nothing: no row
    for label, run in auto.items():
        row, m = rows[run.info.run_name], run.data.metrics
        groups = int(label.split("sc_clusters=")[1].split()[0])
        assert row["chosen k"] == str(int(m["auto_k"])) == str(groups)  # the sc_niid groups, found
        assert row["margin"] == f"{m['auto_margin']:.3f}" and float(row["margin"]) > 0
        assert row["score"] == f"{m['auto_score']:.3f}" and row["value"] == f"{m['auto_value']:.4g} degrees"
        assert row["key"] == "algorithm.beta" and row["decided"] == "before round 0" and row["decisions"] == "1"
        assert row["why"].startswith(f"best mean silhouette {m['auto_score']:.3f} at k={groups}")
    for label, run in sweep["runs"].items():  # every run is still in the final metrics
        assert f"| {run.info.run_name} |" in md
    assert "![auto_choice_curves.png](auto_choice_curves.png)" in md
    _not_blank(out / "auto_choice_curves.png", panels=2)
    with open(out / "auto_choices.csv") as fh:
        decisions = list(csv.DictReader(fh))
    assert sorted(d["run_id"] for d in decisions) == sorted(r.info.run_id for r in auto.values())
    assert {d["k"] for d in decisions} == {"2", "3"}
    html = (out / "report.html").read_text()
    assert f"<h2>{HEADING}</h2>" in html and html.count('src="data:image/png;base64,') == 6
    assert re.search(r"<td>algorithm\.beta</td><td>before round 0</td><td>3</td>", html)
    logged = {a.path for a in sweep["client"].list_artifacts(sweep["parent"], "report")}
    assert {"report/auto_choice_curves.png", "report/auto_choices.csv", "report/report.md"} <= logged


@pytest.mark.slow
def test_report_over_runs_without_auto_keys_has_no_such_section(sweep, report, tmp_path, capsys):
    from flows.cli import main

    _, auto_out = report
    fixed = [run for label, run in sweep["runs"].items() if "beta=25" in label][0]
    out = tmp_path / "fixed"
    out.mkdir()
    for name in ("auto_choice_curves.png", "auto_choices.csv"):  # a report written here before, with auto runs
        (out / name).write_bytes((auto_out / name).read_bytes())
    assert main(["report", fixed.info.run_id, "--no-log", "--tracking-uri", sweep["uri"], "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert f"| {fixed.info.run_name} |" in md and "(a single run)" in md
    assert HEADING not in md and "| chosen k |" not in md and "auto_choice_curves" not in md
    assert not (out / "auto_choice_curves.png").exists() and not (out / "auto_choices.csv").exists()
    assert HEADING not in capsys.readouterr().out


@pytest.mark.slow
def test_missing_or_broken_evidence_is_one_note(sweep, tmp_path, capsys):
    """A run whose params say auto but that has no auto_choices.json (it never finished), and one
    whose artifact is not JSON: the report is written, and the section says why, run by run."""
    from flows.cli import main

    client = sweep["client"]
    exp = sweep["runs"][next(iter(sweep["runs"]))].info.experiment_id
    parent = client.create_run(exp, run_name="lost-parent").info.run_id
    for name, artifact in (("unfinished", None), ("broken", "{not json")):
        run = client.create_run(exp, run_name=name, tags={"mlflow.parentRunId": parent})
        client.log_param(run.info.run_id, "algorithm.beta", "auto")
        client.log_metric(run.info.run_id, "accuracy", 0.5, step=1)
        if artifact:
            client.log_text(run.info.run_id, artifact, "auto_choices.json")
            client.set_terminated(run.info.run_id)
    assert main(["report", parent, "--no-log", "--tracking-uri", sweep["uri"], "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    (note,) = [ln for ln in md.splitlines() if ln.startswith("_No auto evidence: ")]
    assert ("unfinished: algorithm.beta=auto, but no auto_choices.json artifact (it is logged when the run "
            "finishes; status RUNNING)") in note
    assert "broken: auto_choices.json could not be read (" in note
    assert f"## {HEADING}" in md and "| decided |" not in md
    assert not (tmp_path / "r" / "auto_choice_curves.png").exists()
    capsys.readouterr()
