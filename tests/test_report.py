"""`flockfl report` and what a user sees of it: colour maps that fit k, the report over a parent
run's children (real Prefect flows, a real MLflow SQLite store, the real `flockfl` process), and
the MLflow UI in a real headless browser showing the run and the logged report."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_not_blank, browse, flock_env, free_port, needs_chromium, run_flock, tiny_config

EXPERIMENT = "report-test"


# ---------------------------------------------------------------------- colour maps (fast)


def _heatmap_image(monkeypatch, history, groups, tmp_path):
    """Draw ``assignment_heatmap`` and return its AxesImage and colorbar labels (the figure is
    kept from ``plt.close``)."""
    from flockfl import plots

    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)
    plots.assignment_heatmap(np.asarray(history), np.asarray(groups), tmp_path / "hm.png")
    assert (tmp_path / "hm.png").stat().st_size > 0
    fig = figs[0]
    image = fig.axes[0].images[0]
    labels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    return image, labels


@pytest.mark.parametrize("k,unassigned", [(4, False), (4, True), (13, True), (13, False), (25, True)])
def test_assignment_heatmap_has_one_colour_per_cluster(monkeypatch, tmp_path, k, unassigned):
    from matplotlib.colors import BoundaryNorm, to_rgba

    from flockfl.plots import UNASSIGNED_COLOR

    rng = np.random.default_rng(k)
    ids = np.arange(-1 if unassigned else 0, k)
    history = np.resize(ids, (6, 2 * len(ids)))  # every id appears
    rng.shuffle(history, axis=1)
    groups = np.arange(history.shape[1]) % k
    image, labels = _heatmap_image(monkeypatch, history, groups, tmp_path)
    assert isinstance(image.norm, BoundaryNorm)
    assert image.cmap.N == k + unassigned  # exactly k colours (+ grey for "not assigned")
    colours = image.to_rgba(ids[:, None].astype(float))[:, 0]  # what each id is drawn in
    assert len({tuple(np.round(c, 4)) for c in colours}) == len(ids)  # ids map to distinct colours
    if unassigned:
        assert tuple(colours[0]) == pytest.approx(to_rgba(UNASSIGNED_COLOR))
        assert labels[0] == "none"
    # tick labels at the cluster ids (every id up to 20 clusters)
    numeric = [lab for lab in labels if lab != "none"]
    assert numeric == ([str(j) for j in range(k)] if k <= 20 else numeric) and "0" in numeric
    if k == 4:  # tab10's first four, not ten colours spread over 0..9
        import matplotlib.pyplot as plt

        expected = [to_rgba(c) for c in plt.get_cmap("tab10").colors[:4]]
        np.testing.assert_allclose(colours[int(unassigned):], expected)


def test_panels_share_one_scale_and_curves_use_cluster_colours(monkeypatch, tmp_path):
    from flockfl import plots

    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)
    two = np.zeros((3, 4), int)
    two[:, 2:] = 1
    five = np.tile(np.arange(-1, 5), (3, 1))
    plots.assignment_panels([("a", two, np.array([0, 0, 1, 1])), ("b", five, -np.ones(6, int))], tmp_path / "p.png")
    images = [ax.images[0] for ax in figs[0].axes if ax.images]
    assert len(images) == 2 and all(im.cmap.N == 6 for im in images)  # k=5 over both panels, plus grey
    # accuracy curves: cluster j's line has cluster j's heat-map colour
    history = [{"round": r, "loss": 1.0, "accuracy": 0.5, **{f"cluster/{j}/accuracy": 0.1 * j for j in range(3)}}
               for r in (1, 2)]
    plots.accuracy_curves(history, tmp_path / "acc.png")
    lines = {ln.get_label(): ln.get_color() for ln in figs[-1].axes[0].lines}
    for j, colour in enumerate(plots.discrete_colors(3)):
        assert tuple(lines[f"cluster/{j}/accuracy"]) == pytest.approx(colour)


def test_combination_mean_and_band_are_over_seeds():
    from flows.render import RunSummary, combination_stats, combination_table
    from flows.render_figures import _series

    def run(name, group, acc, comm):
        return RunSummary(run_id=name * 4, name=name, status="FINISHED", group=group, seed=name[-1],
                          final={"accuracy": acc[-1], "comm_bytes": comm[-1], "round": 2},
                          history={"accuracy": dict(zip((1, 2), acc)), "comm_bytes": dict(zip((1, 2), comm))})

    runs = [run("lr1-s1", "lr=1", [0.2, 0.4], [1e6, 2e6]), run("lr1-s2", "lr=1", [0.4, 0.8], [1e6, 2e6]),
            run("alone", "alone", [0.5, 0.6], [3e6, 6e6])]
    series = _series(runs, "accuracy", None)
    assert [s["label"] for s in series] == ["lr=1 (mean ± std, 2 seeds)", "alone"]
    np.testing.assert_allclose(series[0]["y"], [0.3, 0.6])
    np.testing.assert_allclose(series[0]["std"], [np.std([0.2, 0.4], ddof=1), np.std([0.4, 0.8], ddof=1)])
    assert series[1]["std"] is None
    np.testing.assert_allclose(_series(runs, "accuracy", "comm_bytes")[1]["x"], [3e6, 6e6])
    (stats,) = combination_stats(runs)  # "alone" has one seed: no combination row
    assert stats["seeds"] == 2 and stats["accuracy_mean"] == pytest.approx(0.6)
    assert stats["accuracy_std"] == pytest.approx(np.std([0.4, 0.8], ddof=1))
    assert stats["comm_mb_mean"] == pytest.approx(2.0)
    header, rows = combination_table(runs)
    assert rows[0][:3] == ["lr=1", "2", "0.6000 ± 0.2828"]


# ---------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A parent MLflow run with two tiny IFCA runs (k=2, rotated, two seeds of one combination)
    as children, made by the real Prefect flow into a SQLite store in a temp folder."""
    from mlflow.tracking import MlflowClient

    from flockfl.experiments import validate
    from flows.experiment import run_experiment
    from flows.tracking.tracker import Tracker

    root = tmp_path_factory.mktemp("report")
    (root / "params.yaml").write_text((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(uri)
    # artifacts in the temp folder, not in ./mlruns of wherever pytest runs
    exp_id = client.create_experiment(EXPERIMENT, artifact_location=str(root / "mlartifacts"))
    parent = Tracker(uri, EXPERIMENT, "study-parent", params={"study": "ifca k=2, two seeds"})
    children = {}
    for seed in (3, 4):
        cfg = validate(tiny_config(
            name="rep", seed=seed, algorithm={"name": "ifca", "k": 2, "init": "random"},
            train={"rounds": 2, "clients_per_round": 8},  # the run's own plots are tested elsewhere
            tracking={"enabled": True, "register_model": False, "plots": False, "experiment": EXPERIMENT}))
        run_dir = root / "runs" / f"ifca-seed{seed}"
        run_dir.mkdir(parents=True)
        out = run_experiment(cfg, run_dir, str(root / "parts"), uri, progress=False, parent_run_id=parent.run_id)
        # what `flockfl sweep` tags its children with: the grid combination and the seed
        client.set_tag(out["run_id"], "flockfl.sweep.combo", "algorithm.k=2")
        client.set_tag(out["run_id"], "flockfl.seed", str(seed))
        children[f"ifca-seed{seed}"] = out["run_id"]
    parent.finish()
    return {"root": root, "uri": uri, "client": client, "experiment_id": exp_id, "parent": parent.run_id,
            "children": children}


@pytest.fixture(scope="module")
def parent_report(study):
    """`flockfl report <parent> --html` through the real `flockfl` process."""
    res = run_flock(["report", study["parent"], "--html", "--tracking-uri", study["uri"]], study["root"])
    out = study["root"] / "runs" / "reports" / f"study-parent-{study['parent'][:8]}"
    return res, out


@pytest.mark.slow
def test_parent_report_covers_the_children(study, parent_report):
    res, out = parent_report
    assert res.returncode == 0, res.stderr
    assert not res.stderr.strip(), res.stderr  # no progress bars, no warnings
    for name in ("report.md", "report.html", "final_metrics.csv", "combination_metrics.csv", "accuracy_per_round.png",
                 "ari_per_round.png", "cluster_assignments.png", "accuracy_vs_comm.png", "accuracy_vs_sim_time.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    md = (out / "report.md").read_text()
    for child in study["children"]:
        assert f"| {child} |" in md and f"| {child} |" in res.stdout  # the table, also on stdout
    assert "| algorithm.k=2 | 2 |" in md and "±" in md  # mean ± std over the two seeds
    assert "ARI" in md and "MB sent" in md and "sim time (s)" in md
    rows = list(csv.DictReader((out / "final_metrics.csv").open()))
    assert sorted(r["run_id"] for r in rows) == sorted(study["children"].values())
    for r in rows:
        assert float(r["rounds"]) == 2 and 0 <= float(r["accuracy"]) <= 1 and float(r["comm_mb"]) > 0
        assert float(r["num_clusters"]) == 2 and -1 <= float(r["ari"]) <= 1 and float(r["sim_time"]) > 0
    html = (out / "report.html").read_text()
    assert f"<title>flockfl report: study-parent ({study['parent']})</title>" in html
    assert html.count('src="data:image/png;base64,') == 5 and "<table>" in html
    assert "src=\"accuracy" not in html  # self-contained: no file references
    # logged to the parent run under report/
    logged = {a.path for a in study["client"].list_artifacts(study["parent"], "report")}
    assert {"report/report.html", "report/report.md", "report/final_metrics.csv",
            "report/cluster_assignments.png"} <= logged
    assert f"{study['parent']}/artifacts/report" in res.stdout and str(out) in res.stdout


@pytest.mark.slow
def test_heatmap_panels_use_k_colours(study, parent_report):
    """The report's heat-maps: one panel per child, two clusters → two colours in the image."""
    from matplotlib.image import imread

    from flockfl.plots import discrete_colors

    _, out = parent_report
    img = (imread(out / "cluster_assignments.png")[..., :3] * 255).round().astype(int)
    palette = (np.array(discrete_colors(10))[:, :3] * 255).round().astype(int)
    present = [bool((np.abs(img - c).sum(-1) == 0).sum() > 200) for c in palette]  # solid patches of it
    assert present[:2] == [True, True] and not any(present[2:])


@pytest.mark.slow
def test_single_run_run_dir_and_sweep_dir(study, tmp_path, capsys):
    from flows.cli import main

    child = study["children"]["ifca-seed3"]
    assert main(["report", child, "--tracking-uri", study["uri"], "--out", str(tmp_path / "one")]) == 0
    md = (tmp_path / "one" / "report.md").read_text()
    assert "| ifca-seed3 |" in md and "ifca-seed4" not in md and "(a single run)" in md
    assert not (tmp_path / "one" / "report.html").exists() and (tmp_path / "one" / "cluster_assignments.png").exists()
    assert "report/report.md" in {a.path for a in study["client"].list_artifacts(child, "report")}
    # a run directory (run.json) and a sweep directory (sweep.json), not logged
    run_dir = study["root"] / "runs" / "ifca-seed4"
    assert main(["report", str(run_dir), "--no-log", "--tracking-uri", study["uri"], "--out", str(tmp_path / "dir")]) == 0
    assert "| ifca-seed4 |" in (tmp_path / "dir" / "report.md").read_text()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(f'{{"parent_run_id": "{study["parent"]}", "tracking_uri": "{study["uri"]}"}}')
    assert main(["report", str(sweep), "--no-log", "--out", str(tmp_path / "sw")]) == 0
    md = (tmp_path / "sw" / "report.md").read_text()
    assert "| ifca-seed3 |" in md and "| ifca-seed4 |" in md
    out = capsys.readouterr().out
    assert "not logged to MLflow (--no-log)" in out


@pytest.mark.slow
@pytest.mark.parametrize("target,message", [
    ("0123456789abcdef0123456789abcdef", "MLflow run 0123456789abcdef0123456789abcdef not found"),
    ("no/such/dir", "is neither a run or sweep directory nor an MLflow run id"),
])
def test_unknown_target_is_one_line(study, capsys, target, message):
    from flows.cli import main

    assert main(["report", target, "--tracking-uri", study["uri"]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flockfl: error: ") and message in err[0], err


@pytest.mark.slow
def test_parent_without_children_is_one_line(study, capsys):
    from flows.cli import main
    from flows.tracking.tracker import Tracker

    empty = Tracker(study["uri"], EXPERIMENT, "empty-parent")
    empty.finish()
    assert main(["report", empty.run_id, "--tracking-uri", study["uri"]]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "has no child runs and no metrics" in line


# ---------------------------------------------------------------------- the MLflow UI in a browser


def _look(url: str, name: str, tmp: Path) -> tuple[Path, str]:
    """Screenshot and rendered DOM of ``url``; asserts the screenshot is a real page."""
    shot = tmp / f"{name}.png"
    dom = browse(url, shot)
    assert_not_blank(shot, min_colours=200)
    return shot, dom


@pytest.mark.slow
@needs_chromium
def test_mlflow_ui_shows_the_run_and_its_report(study, parent_report, tmp_path):
    from flows.tracking.view import ui_url

    res, _ = parent_report
    assert res.returncode == 0, res.stderr
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # one server worker and no job runner: the UI answers in seconds on a small machine
    env = flock_env({"MLFLOW_WORKERS": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    with open(tmp_path / "ui.log", "w") as log:
        ui = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port), "--tracking-uri", study["uri"]],
                              cwd=study["root"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert ui.poll() is None, (tmp_path / "ui.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "MLflow UI did not answer /health in 120 s"
            time.sleep(0.5)
        exp, parent = study["experiment_id"], study["parent"]
        # (0) the experiment as flockfl links it opens on its training runs, not on MLflow 3's
        # GenAI view (an overview of traces, token usage and cost, judges). The experiment was
        # made without flockfl (the fixture); reusing it tagged it as a training experiment
        assert study["client"].get_experiment(exp).tags.get("mlflow.experimentKind") == "custom_model_development"
        _, dom = _look(ui_url(base, exp), "experiment_page", tmp_path)
        assert f"<title>Runs - Experiment {exp} - MLflow</title>" in dom, dom[:2000]  # not "Overview - ..."
        assert "study-parent" in dom and "matching run" in dom  # the runs table, with the parent run
        for genai in ("Token Usage", "Tokens per Trace", "Detect Issues", "Judges"):
            assert genai not in dom, genai
        # (a) the parent run's page in the single-page app
        _, dom = _look(f"{base}/#/experiments/{exp}/runs/{parent}", "run_page", tmp_path)
        assert "study-parent" in dom and parent in dom
        assert "ifca-seed3" in dom and "ifca-seed4" in dom  # its child runs are listed
        # (b) the report in the run's artifact viewer (MLflow renders HTML in a sandboxed iframe)
        _, dom = _look(f"{base}/#/experiments/{exp}/runs/{parent}/artifacts/report/report.html", "report_in_ui", tmp_path)
        assert "study-parent" in dom and "report/report.html" in dom and "mlflow-html-iframe" in dom
        # (c) the artifact as the server serves it (get-artifact sends it as an attachment, so the
        # browser renders the served bytes from a file)
        with urllib.request.urlopen(f"{base}/get-artifact?path=report/report.html&run_uuid={parent}", timeout=30) as r:
            served = r.read()
        assert served == (study["root"] / "runs" / "reports" / f"study-parent-{parent[:8]}" / "report.html").read_bytes()
        (tmp_path / "served_report.html").write_bytes(served)
        _, dom = _look((tmp_path / "served_report.html").as_uri(), "report_served", tmp_path)
        assert f"flockfl report: study-parent ({parent})" in dom and "ifca-seed3" in dom and "ifca-seed4" in dom
        assert dom.count("data:image/png;base64,") == 5
    finally:
        try:
            os.killpg(ui.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        ui.wait()
