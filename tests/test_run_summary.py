"""The record ``flockfl run --json`` prints (flows/run_summary.py's RunRecord): its keys and their
order are a contract (the CLI, sweeps, DVC's metrics file and the benchmarks read them); a key
only some runs have is left out exactly where the flow's summary dict left it out (issue 34)."""

from __future__ import annotations

from dataclasses import fields

from flows.run_summary import RunRecord

EVERY_RUN = ["run_id", "run_dir", "experiment", "algorithm", "mlflow_experiment", "rounds", "resumed_from_round",
             "metrics", "state_sha256", "wall_s", "rounds_wall_s", "phases_s", "round_s_median", "compute_round_s_median",
             "protocol", "reports", "orchestration_ms_median", "engine", "engine_reason", "threads", "cores_wait_s",
             "cores_queued_s", "cores_leased", "partition", "partition_sha256", "partition_cached", "checkpoint_warnings",
             "executor", "clients_dropped", "bytes_total"]


def record(**over) -> RunRecord:
    """Every field None (a key some runs have: absent), then ``over``."""
    return RunRecord(**{**{f.name: None for f in fields(RunRecord)}, **over})


def test_a_plain_run_has_the_keys_every_run_has_in_their_order_none_dropped():
    assert list(record().to_json()) == EVERY_RUN  # run_id, engine, ... are printed as null, not left out


def test_the_keys_some_runs_have_come_in_their_place():
    full = record(notes=["k=1"], target_accuracy=0.9, rounds_to_target=None, sim_time_to_target=None,
                  executor_bytes_to_workers_median=1.0, executor_bytes_from_workers_median=2.0, executor_shards_local=0,
                  pre_federation={"bytes_up": 1}, newcomers={"clients": []}, auto={"decisions": 0})
    out = full.to_json()
    assert list(out) == (EVERY_RUN[:5] + ["notes"] + EVERY_RUN[5:14]
                         + ["target_accuracy", "rounds_to_target", "sim_time_to_target"] + EVERY_RUN[14:28]
                         + ["executor_bytes_to_workers_median", "executor_bytes_from_workers_median", "executor_shards_local"]
                         + EVERY_RUN[28:] + ["pre_federation", "newcomers", "auto"])
    # a target that was not reached is reported as such; no Dask traffic yet is still a Dask run
    assert out["rounds_to_target"] is None and out["sim_time_to_target"] is None and out["executor_shards_local"] == 0


def test_its_values_are_the_fields_themselves():
    phases = {"drive": 1.0}
    assert record(phases_s=phases).to_json()["phases_s"] is phases  # run_experiment and settle add their phases to it
