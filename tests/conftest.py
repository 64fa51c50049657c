"""Shared fixtures. Prefect, MLflow and DVC run for real: Prefect in ephemeral mode with
its home in a temp folder, MLflow on a temp SQLite store, DVC in a temp git repo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_HOME = tempfile.mkdtemp(prefix="flockfl-test-prefect-")
os.environ["PREFECT_HOME"] = _HOME
# every pytest process (each worker of `pytest -n`) leases cores from a folder of its own: the
# runs of two workers, or of the suite and a user's run beside it, share the cores (the same
# bits) instead of waiting for each other and printing a waiting line a test would read
os.environ["FLOCKFL_CORES_DIR"] = os.path.join(_HOME, "cores")
# Prefect's ephemeral API gives its server 60 s to start (import, migrate a new SQLite store):
# with `pytest -n` workers each starting their own beside training tests, that can run out on a
# 2-core machine; a user's run keeps Prefect's default
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# the engine probe's verdicts (train.engine=auto), kept per pytest process, not in the user's cache
os.environ["FLOCKFL_PROBE_CACHE"] = os.path.join(_HOME, "engine-probe.json")
# the resident flockfl (flows/resident.py) that the tests' flockfl commands go through: one per
# test session (its xdist workers inherit the controller's folder), not the user's, gone after the session; each
# command waits for its models (what `flockfl run --wait` does) before it returns
os.environ.setdefault("FLOCKFL_RESIDENT_DIR", os.path.join(
    tempfile.gettempdir(), f"flockfl-tests-{os.getpid()}"))
os.environ.setdefault("FLOCKFL_RESIDENT_IDLE_S", "120")
os.environ.setdefault("FLOCKFL_WAIT", "1")
# partitions the in-process tests build, one folder per pytest process
PARTS = os.path.join(_HOME, "parts")

from flows.env import configure_environment  # noqa: E402

configure_environment(home=_HOME)

import torch  # noqa: E402

torch.set_num_threads(1)


def tiny_config(**over) -> dict:
    """A small digits experiment as a raw (unvalidated) config dict."""
    from flockfl.config import deep_merge

    base = {
        "name": "tiny", "seed": 3,
        "dataset": {"name": "digits"},
        # disjoint: the rotated groups split one dataset (not IFCA's protocol, where every group gets
        # the whole set): the digest corpus and the data tests were recorded on it
        "partition": {"scheme": "rotated", "num_clients": 12, "k": 2, "rotated_mode": "disjoint"},
        "model": {"name": "mlp", "hidden": 16},
        "algorithm": {"name": "fedavg"},
        # one trainer, not auto: auto times both and could pick differently in two runs compared bit for bit
        "train": {"rounds": 3, "clients_per_round": 6, "local_epochs": 1, "batch_size": 16, "lr": 0.1, "engine": "vectorized"},
        "tracking": {"enabled": False},
    }
    return deep_merge(base, over)


@pytest.fixture
def make_cfg():
    from flockfl.experiments import validate

    return lambda **over: validate(tiny_config(**over))


def shared_api() -> str:
    """This pytest process's Prefect API (``flows.apiserver``: a real server, tied to this
    process, on 127.0.0.1), started at the first call. The ``flockfl`` subprocesses of the tests
    use it as a user's configured API (``flockfl server``), so each does not start and import a
    server of its own (~5 s of CPU each, the suite's largest fixed cost); tests of the
    per-process API pass ``per_process=True``. ``FLOCKFL_TEST_SHARED_API=0`` turns it off."""
    from flows import apiserver

    server = apiserver.start(home=_HOME)
    apiserver.wait_ready(180)
    return server.api_url if server is not None else apiserver.configured_api_url()


def flock_env(extra: dict | None = None, per_process: bool = False) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env.pop("FLOCKFL_CRASH_AT", None)
    # a flockfl subprocess uses this process's API (an in-process `flockfl run` of an earlier test
    # pointed PREFECT_API_URL at the same per-process server), or starts its own (per_process)
    env.pop("PREFECT_API_URL", None)
    if per_process:  # a process of its own, as with FLOCKFL_RESIDENT=off
        env["FLOCKFL_RESIDENT"] = "off"
    if not per_process and os.environ.get("FLOCKFL_TEST_SHARED_API", "1") != "0":
        env["PREFECT_API_URL"] = shared_api()
    # mlflow.set_tracking_uri (an in-process Tracker of an earlier test) exports
    # MLFLOW_TRACKING_URI: a flockfl subprocess would log to that test's store, not to its cwd's
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra or {})
    return env


def run_flock(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the real `flockfl` command in a subprocess, in its own session (see run_in_session)."""
    return run_in_session([sys.executable, "-m", "flows.cli", *args], cwd, flock_env(env), timeout)


def run_in_session(cmd: list[str], cwd: Path | None = None, env: dict | None = None,
                   timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; output goes to files, not pipes, and afterwards the
    whole process group is killed. A child that outlives the command (a browser's helper, or
    a server a killed process left behind) would otherwise hold inherited pipes open, and
    reading them to EOF would hang."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


needs_chromium = pytest.mark.skipif(shutil.which("chromium") is None,
                                    reason="chromium is not installed (Debian: apt-get install -y chromium)")


def browse(url: str, png: Path, timeout: int = 120) -> str:
    """Headless Chromium, as a person would see ``url``: a 1400×1000 screenshot into ``png``
    and the DOM after the page's scripts ran (one load gives both)."""
    res = run_in_session(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                          f"--user-data-dir={png.parent / 'chromium-profile'}", "--window-size=1400,1000",
                          "--virtual-time-budget=20000", f"--screenshot={png}", "--dump-dom", url], timeout=timeout)
    assert png.is_file(), res.stderr[-2000:]
    return res.stdout


def assert_not_blank(png: Path, min_colours: int = 100) -> tuple[float, int]:
    """The screenshot is a real page: full size, real contrast, many colours (not one blank
    or single-colour page). Returns (pixel std, distinct colours)."""
    from matplotlib.image import imread

    img = imread(png)[..., :3]
    colours = len(np.unique((img.reshape(-1, 3) * 255).round().astype(np.uint8), axis=0))
    print(f"{png}: {img.shape[1]}x{img.shape[0]} std={img.std():.3f} colours={colours}")
    assert img.shape[:2] == (1000, 1400) and img.std() > 0.05 and colours > min_colours, (png, img.std(), colours)
    return float(img.std()), colours


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A project folder with the repo's params.yaml, for CLI runs."""
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    return tmp_path


# ---------------------------------------------------------------------- shared algorithm checks


def rel_err(a: dict, b: dict) -> float:
    """The largest relative difference over the parameters of two stacked-model dicts."""
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)


def assert_trainers_agree(cfg_of, tmp_path, tol: float = 1e-5):
    """``cfg_of(engine)`` → a config; both trainers give the same models (to ``tol``) and the
    same assignments. Returns the two final states (reference, vectorized)."""
    from flockfl.rounds import prepare, run_rounds

    ref, vec = (run_rounds(prepare(cfg_of(e), tmp_path)) for e in ("reference", "vectorized"))
    assert {k: v.shape for k, v in ref.models.items()} == {k: v.shape for k, v in vec.models.items()}
    assert rel_err(vec.models, ref.models) < tol
    np.testing.assert_array_equal(vec.assignments, ref.assignments)
    return ref, vec


def assert_resume_bit_identical(cfg, tmp_path, until: int = 2, prepare_resumed=None):
    """Run ``cfg`` whole, and to ``until`` rounds then checkpoint → load → continue in a fresh
    context (``prepare_resumed(prep)`` may sabotage it, e.g. forbid a hook): equal digests and
    equal last-round metrics."""
    from flockfl.rounds import PLAIN, drive, prepare, run_rounds
    from flockfl.state import load_latest, save_checkpoint

    full = run_rounds(prepare(cfg, tmp_path))
    half = run_rounds(prepare(cfg, tmp_path), until=until)
    save_checkpoint(half, tmp_path / "run")
    restored, _ = load_latest(tmp_path / "run")
    prep = prepare(cfg, tmp_path)
    if prepare_resumed:
        prepare_resumed(prep)
    resumed = drive(prep, restored, PLAIN)
    assert resumed.digest() == full.digest()
    # the last round's metrics too (all but its wall time)
    assert resumed.history[-1] == {**full.history[-1], "round_time_s": resumed.history[-1]["round_time_s"]}
    return full, resumed


def assert_mid_round_resume(cfg, tmp_path, round: int = 1, cycle: int = 2):
    """A multi-cycle run (FedCluster) killed after ``cycle`` cycles of round ``round`` and
    resumed from that mid-round checkpoint in a fresh context ends as the uninterrupted run:
    equal digests and histories (but wall times). Returns the mid-round state."""
    from flockfl.rounds import PLAIN, drive, prepare, run_rounds
    from flockfl.state import load_latest, save_checkpoint

    full = run_rounds(prepare(cfg, tmp_path))
    mids = []
    drive(prepare(cfg, tmp_path), None, PLAIN, until=round + 1, on_cycle=mids.append)
    mid = [s for s in mids if s.round == round and s.driver.partial_round["cycle"] == cycle][0]
    save_checkpoint(mid, tmp_path / "run")
    restored, _ = load_latest(tmp_path / "run")
    resumed = drive(prepare(cfg, tmp_path), restored, PLAIN)
    assert resumed.digest() == full.digest()
    strip = lambda h: {k: v for k, v in h.items() if k != "round_time_s"}  # noqa: E731
    assert [strip(h) for h in resumed.history] == [strip(h) for h in full.history]
    return mid


def label_group_npz(path, groups, per_group: int, n: int, seed: int = 0, features=None):
    """An npz of natural clients: group g's clients hold only the labels ``groups[g]`` (n train,
    n/2 test samples each). ``features(rng)`` returns ``y → x`` ([m, 1, 4, 4]); by default
    x = N(0, 1) + y. Returns the true group of every client."""
    rng = np.random.default_rng(seed)
    feat = features(rng) if features else (lambda y: rng.normal(size=(len(y), 1, 4, 4)).astype(np.float32) + y[:, None, None, None])
    xs, ys, cs, xt, yt, ct, truth = [], [], [], [], [], [], []
    client = 0
    for g, labels in enumerate(groups):
        for _ in range(per_group):
            for xo, yo, co, m in ((xs, ys, cs, n), (xt, yt, ct, n // 2)):
                yo.append(rng.choice(labels, size=m))
                xo.append(feat(yo[-1]))
                co.append(np.full(m, client))
            truth.append(g)
            client += 1
    cat = np.concatenate
    np.savez(path, x_train=cat(xs), y_train=cat(ys), x_test=cat(xt), y_test=cat(yt), client_train=cat(cs),
             client_test=cat(ct), group=np.array(truth))
    return np.array(truth)


def spy(obj, name: str) -> list:
    """Wrap ``obj.name`` so that the positional arguments of every call are recorded (the call
    still happens); returns the list they are appended to."""
    calls, orig = [], getattr(obj, name)

    def wrapper(*args, **kw):
        calls.append(args)
        return orig(*args, **kw)

    setattr(obj, name, wrapper)
    return calls


def flockfl_run(cfg_dict: dict, parts: Path, dtype=None):
    """flockfl's run for a lockstep test against a written-out reference loop (the NIID-Bench and
    curriculum-thesis tests): the round-0 model, the global parameters after each round, each round's
    accuracy, the cohorts and the partition's training indices."""
    import torch

    from flockfl.experiments import validate
    from flockfl.rng import np_rng
    from flockfl.rounds import prepare, run_rounds

    prep = prepare(validate(cfg_dict), parts)
    if dtype is not None and dtype != torch.float32:  # the model and the inputs in that dtype (the update rules are dtype-blind)
        prep.ctx.model.to(dtype)
        d = prep.ctx.data
        d.train.x, d.test.x = d.train.x.to(dtype), d.test.x.to(dtype)
        if d.pool is not None:
            d.pool.x = d.pool.x.to(dtype)
    init = {k: v[0].clone() for k, v in prep.algorithm.init_state(prep.ctx).models.items()}
    after: list[dict] = []
    state = run_rounds(prep, on_round=lambda st, row: after.append({k: v[0].clone() for k, v in st.models.items()}))
    cohorts = [np.sort(np_rng(prep.cfg.seed, r, purpose="select").choice(prep.ctx.num_clients, size=prep.cfg.train.clients_per_round,
                                                                       replace=False)) for r in range(prep.cfg.train.rounds)]
    return prep, init, after, [row["accuracy"] for row in state.history], cohorts


def pytest_sessionfinish(session):
    """The session's residents leave once their commands ended (the controller, or a lone
    pytest process; xdist workers share the controller's)."""
    if not hasattr(session.config, "workerinput") and os.environ.get("FLOCKFL_RESIDENT_DIR", "").startswith(
            os.path.join(tempfile.gettempdir(), "flockfl-tests-")):
        from flows import resident

        resident.stop()
        shutil.rmtree(os.environ["FLOCKFL_RESIDENT_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``worksteal`` (``./run test``), the end-to-end tests (marked slow) start
    first: worksteal hands worker j the j-th contiguous block of the collection and later lets idle
    workers take the tail of a busy one's queue, so each block is arranged as its share of the slow
    tests (whole modules, so that a module's set-up runs once on one worker), then unit tests. A
    long test that starts last otherwise holds the suite's end (its minute-long process tests,
    alphabetically late, ran while the other workers had finished). The tests and what they check
    are unchanged; only the order is."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if n < 2 or config.getoption("dist", "no") != "worksteal":
        return
    by_module: dict[str, list] = {}
    fast = []
    for item in items:
        if item.get_closest_marker("slow") is not None:
            by_module.setdefault(str(item.path), []).append(item)
        else:
            fast.append(item)
    if not by_module:
        return
    sizes, left = [], len(items)  # the blocks worksteal deals: len // n, then the rest again
    for j in range(n):
        sizes.append(left // (n - j))
        left -= sizes[-1]
    slow: list[list] = [[] for _ in range(n)]
    for _, group in sorted(by_module.items(), key=lambda kv: -len(kv[1])):  # the largest module first
        min(slow, key=len).extend(group)
    out, taken = [], 0
    for j in range(n):
        need = max(sizes[j] - len(slow[j]), 0)
        out += slow[j] + fast[taken:taken + need]
        taken += need
    items[:] = out + fast[taken:]
