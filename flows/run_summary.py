"""The summary of one experiment flow, the record ``flockfl run --json`` prints: :class:`RunRecord`
holds it as typed fields, built from the finished run by :meth:`RunRecord.of`, and
:meth:`RunRecord.to_json` writes it as the dict the flow returns (its keys, their order and
values are a contract: the CLI, sweeps, schedules, DVC's metrics file and the benchmarks read
them); :func:`summary_lines`, what ``flockfl run`` prints of it without ``--json``. Also the
notes a configuration makes of its method (:func:`method_notes`), shown in the summary and on
the MLflow run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np

from flockfl.algorithms import auto
from flockfl.config import ExperimentConfig
from flockfl.eval_summary import summarise
from flockfl.rounds import PreparedRun
from flockfl.state import ServerState
from flows.run_clock import RoundClock


def method_notes(cfg: ExperimentConfig) -> list[str]:
    from flockfl.algorithms import ALGORITHMS

    return ALGORITHMS[cfg.algorithm.name].notes(cfg)


def _executor_summary(history: list[dict]) -> dict:
    """Per-round medians of the traffic between the flow and the Dask workers."""
    keys = ("executor_bytes_to_workers", "executor_bytes_from_workers")
    rows = [h for h in history if keys[0] in h]
    out = {f"{k}_median": float(np.median([h[k] for h in rows])) if rows else float("nan") for k in keys}
    out["executor_shards_local"] = int(sum(h.get("executor_shards_local", 0) for h in rows))
    return out


def _left_out_without(key: str):
    """A field the summary has only when field ``key`` is not None (``key`` itself included)."""
    return field(metadata={"left_out_without": key})


@dataclass
class RunRecord:
    """One run's summary, in the order of its JSON keys. A field made with
    :func:`_left_out_without` is a key only some runs have: it is left out when the field
    it names is None."""

    run_id: Optional[str]  # the MLflow run (None without tracking)
    run_dir: str
    experiment: str
    algorithm: str
    mlflow_experiment: str
    notes: Optional[list[str]] = _left_out_without("notes")  # method_notes, when there are any
    rounds: int
    resumed_from_round: int
    metrics: dict[str, Any]  # flockfl.eval_summary.summarise's, under the run's protocol
    state_sha256: str
    wall_s: float
    # the rounds this process ran (checkpoints and logging included) and the algorithm's one-shot
    # pre-federation step: the run's compute; what the process spends beyond it is fixed cost
    rounds_wall_s: float
    phases_s: dict[str, float]  # where the flow's time went (drive includes the rounds)
    round_s_median: float
    compute_round_s_median: float
    # with train.target_accuracy: the first round that reached it and its simulated time (None if none did)
    target_accuracy: Optional[float] = _left_out_without("target_accuracy")
    rounds_to_target: Optional[int] = _left_out_without("target_accuracy")
    sim_time_to_target: Optional[float] = _left_out_without("target_accuracy")
    protocol: dict[str, Any]
    reports: dict[str, dict[str, float]]
    orchestration_ms_median: float
    engine: Optional[str]
    engine_reason: Optional[str]
    threads: int
    # the core lease (flockfl.cores): cores_wait_s, how long the rounds waited for this run's cores;
    # cores_queued_s, from the request (set-up went on meanwhile) to the grant; cores_leased, their CPU ids
    cores_wait_s: float
    cores_queued_s: float
    cores_leased: list[int]
    partition: str
    partition_sha256: str
    partition_cached: bool
    checkpoint_warnings: list[str]
    executor: str
    # executor.kind=dask: per-round medians of the traffic with the workers, shards trained here
    executor_bytes_to_workers_median: Optional[float] = _left_out_without("executor_shards_local")
    executor_bytes_from_workers_median: Optional[float] = _left_out_without("executor_shards_local")
    executor_shards_local: Optional[int] = _left_out_without("executor_shards_local")
    clients_dropped: int
    # every byte sent: the rounds' transfers plus the one-shot pre-federation upload/download
    bytes_total: int
    pre_federation: Optional[dict[str, Any]] = _left_out_without("pre_federation")
    newcomers: Optional[dict[str, Any]] = _left_out_without("newcomers")
    auto: Optional[dict[str, Any]] = _left_out_without("auto")  # flockfl.algorithms.auto.summary

    @classmethod
    def of(cls, cfg: ExperimentConfig, prep: PreparedRun, state: ServerState, *, run_id: Optional[str],
           run_dir: Path, resumed_from: int, clock: RoundClock, leased: dict, warnings: list[str], remote: bool,
           t_start: float) -> RunRecord:
        """The record of the run the flow just ran: ``leased`` is what the core lease waited
        (``flows.leases.wait_for_cores``), ``remote`` whether it trained on Dask, ``t_start``
        when the flow body started."""
        summary = summarise(state, cfg.train.target_accuracy)
        return cls(
            run_id=run_id,
            run_dir=str(run_dir),
            experiment=cfg.name,
            algorithm=cfg.algorithm.name,
            mlflow_experiment=cfg.tracking.experiment or cfg.name,
            notes=method_notes(cfg) or None,
            rounds=state.round,
            resumed_from_round=resumed_from,
            metrics=summary["metrics"],
            state_sha256=state.digest(),
            wall_s=time.perf_counter() - t_start,
            rounds_wall_s=clock.rounds_wall_s(),
            phases_s=clock.phases,
            round_s_median=clock.round_s_median(),
            compute_round_s_median=summary["round_s_median"],
            target_accuracy=summary.get("target_accuracy"),
            rounds_to_target=summary.get("rounds_to_target"),
            sim_time_to_target=summary.get("sim_time_to_target"),
            protocol=summary["protocol"],
            reports=summary["reports"],
            orchestration_ms_median=clock.orchestration_ms_median(),
            engine=state.driver.engine,
            engine_reason=state.driver.engine_reason,
            threads=prep.threads,
            **leased,
            partition=str(prep.partition_path),
            partition_sha256=prep.partition_hash,
            partition_cached=prep.partition_cached,
            checkpoint_warnings=warnings,
            executor=cfg.executor.kind,
            **(_executor_summary(state.history) if remote else dict.fromkeys(
                ("executor_bytes_to_workers_median", "executor_bytes_from_workers_median", "executor_shards_local"))),
            clients_dropped=int(sum(h.get("clients_dropped", 0) for h in state.history)),
            bytes_total=int(sum(h.get("bytes_total", 0) for h in state.history)
                            + sum(v for k, v in (state.driver.pre_federation or {}).items() if k.startswith("bytes"))),
            pre_federation=state.driver.pre_federation,
            newcomers=state.driver.newcomers,
            auto=auto.summary(state.meta) if auto.META_KEY in state.meta else None,
        )

    def to_json(self) -> dict[str, Any]:
        """The summary as ``flockfl run --json`` prints it: every field by its name, in order, but
        those a run has not (see :func:`_left_out_without`). The values are the fields themselves,
        not copies."""
        out = {}
        for f in fields(self):
            key = f.metadata.get("left_out_without")
            if key is None or getattr(self, key) is not None:
                out[f.name] = getattr(self, f.name)
        return out


def summary_lines(s: dict) -> list[str]:
    """The run's summary as people read it: at most about 12 lines (``--json`` has everything)."""
    m = s.get("metrics", {})

    def num(key: str, label: str = "") -> str:
        v = m.get(key)
        return f"{label or key} {v:.4f}" if isinstance(v, float) else (f"{label or key} {v}" if v is not None else "")

    def line(label: str, *parts: str) -> None:
        parts = [p for p in parts if p]
        if parts:
            lines.append(f"  {label.ljust(10)}  {'  '.join(parts)}")

    proto = s.get("protocol") or {}
    how = ", ".join(str(proto[k]) for k in ("test_set", "average", "report") if proto.get(k))
    rs = s.get("round_s_median", float("nan"))
    lines = [f"{s.get('experiment')}: {s.get('algorithm') or ''} {s.get('rounds')} rounds in {s.get('wall_s', 0):.1f} s"
             f" ({rs:.3f} s a round, {s.get('engine') or '?'} trainer)".replace(":  ", ": ")]
    line("accuracy", num("accuracy", "mean").removeprefix("mean "), num("accuracy_p10", "p10"), num("accuracy_min", "min"),
         num("loss"), f"[{how}]" if how else "")
    line("personal", num("accuracy_personal", "mean").removeprefix("mean "), num("accuracy_personal_p10", "p10"))
    line("global", num("accuracy_global", "mean").removeprefix("mean "))
    line("finetuned", num("accuracy_finetuned", "mean").removeprefix("mean "), num("accuracy_finetuned_p10", "p10"))
    line("pruned", num("accuracy_pruned", "mean").removeprefix("mean "), num("sparsity"))
    if "num_clusters" in m:
        line("clusters", str(m["num_clusters"]), num("ari", "ARI"), num("nmi", "NMI"))
    if s.get("target_accuracy") is not None:
        hit = s.get("rounds_to_target")
        line("target", f"accuracy {s['target_accuracy']}: " + (
            f"reached at round {hit}, sim_time {s['sim_time_to_target']:.1f}s" if hit else "not reached"))
    for note in s.get("notes", []):
        line("note", note)
    if s.get("clients_dropped"):
        line("dropped", f"{s['clients_dropped']} client trainings failed and were dropped (see --json)")
    for w in s.get("checkpoint_warnings", [])[:2]:
        lines.append(f"  warning: {w}")
    line("run dir", str(s.get("run_dir")))
    if s.get("run_id"):
        line("MLflow", f"run {s['run_id'][:12]}…", f"browse: flockfl ui --tracking-uri {s.get('tracking_uri')} "
                                                    f"--experiment {s.get('mlflow_experiment') or s.get('experiment')}")
        if s.get("export") == "background":
            line("models", "exporting in the background; the MLflow run is FINISHED when they are registered (--wait waits)")
    lines.append("  (every metric and convention: flockfl run ... --json, or the MLflow run)")
    return lines
