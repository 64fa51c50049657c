"""executor.kind=dask: training shards on a real distributed.LocalCluster through Prefect's
DaskTaskRunner give the local run's state bit for bit (FedAvg, SCAFFOLD, IFCA), move only the
shards' rows, survive a worker killed mid-round, and connect to an existing scheduler."""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket

import numpy as np
import pytest
import torch
import yaml

from conftest import tiny_config

# three shards per round (6 clients, shard_size 2)
CONFIGS = {
    "fedavg": {"algorithm": {"name": "fedavg"}},
    # failing clients: the retry and the flow's one-by-one isolation run as in a local run
    "scaffold": {"algorithm": {"name": "scaffold"}, "train": {"simulate_failures": [1, 2, 3]}},
    "ifca": {"algorithm": {"name": "ifca", "k": 2, "init": "random"}},
    # the baselines' mechanisms: clusters that split, partial sharing, a personal model per client
    # (a client-state table), and the solver-based personal methods (their solver travels in the job)
    "cfl": {"algorithm": {"name": "cfl", "eps1": 1e9, "eps2": 0.0, "warmup_rounds": 1}},
    "fedrep": {"algorithm": {"name": "fedrep"}},
    "apfl": {"algorithm": {"name": "apfl"}},
    "pfedme": {"algorithm": {"name": "pfedme"}},
    "perfedavg": {"algorithm": {"name": "perfedavg", "variant": "hf"}},
    # algorithm.*=auto: a choice every round (FedAC) and one before round 0 (PACFL) are made on the
    # flow from the workers' results, so they are the local run's, evidence included
    "fedac_auto": {"algorithm": {"name": "fedac", "k": "auto"}},
    "pacfl_auto": {"algorithm": {"name": "pacfl", "beta": "auto"}},
}


def config(name: str, **executor):
    from flockfl.config import deep_merge
    from flockfl.experiments import validate

    over = deep_merge({"train": {"shard_size": 2, "threads": 1}}, CONFIGS[name])
    return validate(tiny_config(**over, **({"executor": executor} if executor else {})))


# ---------------------------------------------------------------------- units (no cluster)


def test_shard_size_fits_free_gpu_memory():
    from flockfl.executor import shard_size_for

    gib = 1 << 30
    assert shard_size_for(8 * gib, 10 << 20, 256) == 256  # 655 would fit: capped at train.shard_size
    assert shard_size_for(1 * gib, 10 << 20, 256) == 81  # 0.8 GiB / 10 MiB
    assert shard_size_for(1 * gib, 10 << 20, 256, fraction=0.5) == 51
    assert shard_size_for(1 << 20, 10 << 20, 256) == 1  # never below one client
    assert shard_size_for(1 * gib, 0, 64) == 64


def test_client_bytes_counts_parameters_and_activations():
    from flockfl.executor import activation_numel, client_bytes
    from models import build_model

    model = build_model("mlp", (1, 8, 8), 10, 16)
    params = sum(p.numel() for p in model.parameters())
    acts = activation_numel(model, (1, 8, 8))
    assert acts >= 16 + 10  # at least the hidden layer's and the logits' outputs
    assert client_bytes(params, acts, 64, 32) == 4 * (6 * params + 32 * (64 + 3 * acts))


def test_a_job_carries_only_its_shard_rows():
    from flockfl.executor import compact

    cohort = torch.randn(100, 1000)
    rows = cohort[10:12]
    assert len(pickle.dumps(compact(rows))) < len(pickle.dumps(rows)) / 20
    assert torch.equal(compact(rows), rows)
    model = torch.randn(4, 1000)
    broadcast = model[1].unsqueeze(0).expand(50, 1000)  # FedAvg's initial models: one model, 50 rows
    small = compact(broadcast)
    assert small.stride() == (0, 1) and torch.equal(small, broadcast)
    assert len(pickle.dumps(small)) < 1000 * 4 * 1.5


def _job(cfg, root, prep, **over):
    from flockfl import rounds, training
    from flockfl.executor import ShardJob, context_key

    state = prep.algorithm.init_state(prep.ctx)
    state, spec = rounds.select_stage(prep, state, 0)
    base = dict(config=cfg.model_dump(), context_key=context_key(cfg), data_root=str(root),
                partition_hash=prep.partition_hash, shift=None, spec=training.split_spec(spec, 2)[0],
                engine="vectorized", round=0)
    return ShardJob(**{**base, **over}), spec


def test_worker_trains_like_the_flow_and_refuses_other_data(tmp_path):
    """run_job in this process: the same result as rounds.train_shard; a partition the worker
    cannot find, or one with another content hash, is a one-line ExecutorError."""
    from flockfl import rounds, training
    from flockfl.executor import ExecutorError, clear_cache, pack, run_job, unpack_result

    cfg = config("fedavg")
    prep = rounds.prepare(cfg, tmp_path / "parts")
    job, spec = _job(cfg, tmp_path / "parts", prep)
    clear_cache()
    out, info = unpack_result(run_job(pack(job)), torch.device("cpu"))
    ref = training.train_shard(prep.ctx, job.spec, "vectorized", 0, tuple(prep.stages.values()))
    assert info["pieces"] == 1 and np.array_equal(out.clients, ref.clients)
    assert all(torch.equal(out.params[k], ref.params[k]) for k in ref.params)
    for bad, needle in ((dict(data_root=str(tmp_path / "elsewhere")), "does not exist"),
                        (dict(partition_hash="0" * 64), "not the flow's")):
        clear_cache()
        with pytest.raises(ExecutorError, match=needle) as err:
            run_job(pack(_job(cfg, tmp_path / "parts", prep, **bad)[0]))
        assert "\n" not in str(err.value) and "executor.data_root" in str(err.value)
    clear_cache()


def test_a_worker_that_cannot_read_the_data_is_not_retried():
    from prefect.states import Failed

    import tasks
    from flockfl.errors import ExecutorError

    assert not tasks._retry_unless_setup_error(None, None, Failed(data=ExecutorError("no partition")))
    assert tasks._retry_unless_setup_error(None, None, Failed(data=RuntimeError("diverged")))


def test_address_needs_dask_kind():
    from flockfl.errors import ConfigError
    from flockfl.experiments import validate

    with pytest.raises(ConfigError, match="executor.address: a Dask scheduler address needs executor.kind=dask"):
        validate(tiny_config(executor={"address": "tcp://127.0.0.1:8786"}))


# ---------------------------------------------------------------------- on a real LocalCluster


@pytest.fixture(scope="module")
def cluster():
    """An existing two-worker cluster the flows connect to by executor.address."""
    from distributed import LocalCluster

    from flows.dask import own_thread_env

    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    with own_thread_env():
        c = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                         scheduler_kwargs={"dashboard_address": "127.0.0.1:0"}, silence_logs=logging.ERROR)
    with c:
        yield c


def test_a_local_cluster_leaves_the_drivers_thread_count_alone():
    """distributed sets OMP_NUM_THREADS=1 in the process that starts a LocalCluster; flockfl reads
    it for a run's threads, so without own_thread_env every later run would change its bits."""
    from distributed import LocalCluster

    from flockfl.engine.runtime import resolve_threads
    from flows.dask import own_thread_env

    before = (os.environ.get("OMP_NUM_THREADS"), resolve_threads())
    with own_thread_env():
        c = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                         scheduler_kwargs={"dashboard_address": "127.0.0.1:0"}, silence_logs=logging.ERROR)
    c.close()
    assert (os.environ.get("OMP_NUM_THREADS"), resolve_threads()) == before


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(name, tag, cfg) → the flow's summary (and the final state's history), cached."""
    from flockfl.state import load_latest
    from flows.experiment import run_experiment

    root = tmp_path_factory.mktemp("dask")
    done: dict = {}

    def run(name: str, tag: str, cfg):
        if (name, tag) not in done:
            out = run_experiment(cfg, root / f"{name}-{tag}", str(root / "parts"), f"sqlite:///{root}/mlflow.db",
                                 progress=False)
            state, _ = load_latest(root / f"{name}-{tag}")
            done[name, tag] = out, state.history
        return done[name, tag]

    run.root = root
    return run


def _training_bytes(cfg, root) -> int:
    from flockfl import rounds, training

    return len(pickle.dumps(rounds.prepare(cfg, root / "parts").ctx.data.train))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_dask_state_equals_local(cluster, runs, name):
    local, _ = runs(name, "local", config(name))
    remote, history = runs(name, "dask", config(name, kind="dask", address=cluster.scheduler_address))
    assert remote["state_sha256"] == local["state_sha256"]
    assert remote["clients_dropped"] == local["clients_dropped"]
    assert remote["metrics"] == local["metrics"]
    assert remote["executor"] == "dask" and local["executor"] == "local"
    assert remote.get("auto") == local.get("auto") and (("auto" in local) == name.endswith("_auto"))
    # every round sent three shards' rows, never the data: far below the pickled training set;
    # pFedMe (train_all_clients) also sends its companions, the 6 unsampled of the 12 clients
    data = _training_bytes(config(name), runs.root)
    # FedAC sends each client two whole models (its own ω_i and the anchor of its pull): ~40 KB a
    # shard of two clients here, a tenth of the pickled training set; the others under a twelfth
    share = 8 if name == "fedac_auto" else 12
    for row in history:
        shards = row["executor_shards"]
        assert shards == (6 if name == "pfedme" else 3)
        assert 0 < row["executor_bytes_to_workers"] / shards < data / share, (row["executor_bytes_to_workers"], data)
        assert 0 < row["executor_bytes_from_workers"] / shards < data / 12
    assert remote["executor_bytes_to_workers_median"] > 0
    if name == "scaffold":  # the simulated failures: isolated in the flow, as locally
        assert local["clients_dropped"] > 0 and remote["executor_shards_local"] > 0
    else:
        assert remote["executor_shards_local"] == 0


@pytest.mark.slow
def test_workers_that_cannot_read_the_partition_stop_the_run(cluster, runs, tmp_path):
    """No silent fallback to training in the flow: the worker's one-line error ends the run."""
    from flockfl.errors import ExecutorError
    from flows.experiment import run_experiment

    cfg = config("fedavg", kind="dask", address=cluster.scheduler_address, data_root=str(tmp_path / "empty"))
    (tmp_path / "run").mkdir()  # as `flockfl run` makes it: the flow writes error.log there
    with pytest.raises(ExecutorError, match="cannot read the partition"):
        run_experiment(cfg, tmp_path / "run", str(runs.root / "parts"), f"sqlite:///{tmp_path}/m.db", progress=False)


def _children() -> dict:
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out[p.pid] = p.cmdline()
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
def test_worker_killed_mid_round_loses_no_client(runs, monkeypatch, tmp_path):
    """A LocalCluster started by flockfl; the first worker to start a round-1 shard SIGKILLs
    itself. Dask reschedules the shard on the other worker: same state, nobody dropped, and
    the cluster's processes are gone afterwards."""
    local, _ = runs("fedavg", "local", config("fedavg"))
    sentinel = tmp_path / "killed"
    monkeypatch.setenv("FLOCKFL_KILL_WORKER_AT", f"1:{sentinel}")
    before = _children()
    remote, history = runs("fedavg", "killed", config("fedavg", kind="dask", workers=2))
    assert sentinel.exists(), "no worker was killed"
    assert remote["state_sha256"] == local["state_sha256"]
    assert remote["clients_dropped"] == 0 and remote["executor_shards_local"] == 0
    assert [h["clients"] for h in history] == [6, 6, 6]
    left = {pid: cmd for pid, cmd in _children().items() if pid not in before}
    assert not left, f"processes left behind: {left}"


@pytest.mark.slow
def test_bad_address_is_one_line_exit_2(workdir, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.chdir(workdir)
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(tiny_config()))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["run", "tiny.yaml", "--run-dir", "runs/bad", "--no-progress", "--tracking-uri", f"sqlite:///{workdir}/m.db",
               "--set", "executor.kind=dask", "--set", f"executor.address=tcp://127.0.0.1:{port}",
               "--set", "executor.connect_timeout_s=1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("flockfl: error: executor.address: cannot reach a Dask scheduler at") and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_local_run_continues_on_dask(cluster, workdir, monkeypatch, capsys):
    """The executor is not part of a run's identity: a run `flockfl run` started locally (here its
    last checkpoint is removed, as if it had been killed) continues on the cluster with
    `flockfl run --resume --set executor.kind=dask`, instead of being moved aside."""
    from flows.cli import main

    monkeypatch.chdir(workdir)
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(train={"shard_size": 2, "threads": 1})))
    common = ["tiny.yaml", "--run-dir", "runs/r", "--no-progress", "--json"]
    assert main(["run", *common]) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (workdir / "runs/r/checkpoints/ckpt-000003.pt").unlink()
    assert main(["run", *common, "--resume", "--set", "executor.kind=dask",
                 "--set", f"executor.address={cluster.scheduler_address}"]) == 0
    out = capsys.readouterr()
    resumed = json.loads(out.out.strip().splitlines()[-1])
    assert "config changed" not in out.err
    assert resumed["executor"] == "dask" and resumed["resumed_from_round"] == 2 and resumed["rounds"] == 3
    assert resumed["state_sha256"] == local["state_sha256"]
