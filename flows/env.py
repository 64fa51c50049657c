"""Environment defaults for every entry point (CLI, tests, DVC stages).

Call :func:`configure_environment` before Prefect or MLflow is imported. Each value is a
default: anything the user already exported wins.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULTS = {
    # No telemetry: the machines running flockfl are often offline.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "true",
    "DVC_NO_ANALYTICS": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # The ephemeral server records task-run events one by one by default; after a burst the
    # SQLite backlog makes the API answer 503 and the client backs off for up to a minute
    # (the "stall at exit"). Recording in batches of 200 removes the backlog.
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "200",
    # Services of a Prefect server that an ephemeral, per-process API never needs (it cannot
    # schedule, has no automations, and dies with the run). They only apply to servers that
    # flockfl itself starts; a server you run keeps its own settings. Measured: ~20 ms less
    # per W1 round on 2 cores, where the server shares the CPU with training.
    **{f"PREFECT_SERVER_SERVICES_{s}_ENABLED": "false" for s in (
        "TRIGGERS", "EVENT_PERSISTER", "SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS",
        "REPOSSESSOR", "CANCELLATION_CLEANUP", "CLEANUP_RECONCILER")},
    # Quiet by default: flockfl reports errors itself, in one line (--verbose restores INFO).
    "PREFECT_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_TO_API_ENABLED": "false",
    # Ephemeral servers would otherwise start a UI build and print a banner.
    "PREFECT_UI_ENABLED": "false",
    "GIT_PYTHON_REFRESH": "quiet",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    # Bit-identical resume: MKL (torch's CPU BLAS) picks kernels by memory alignment unless
    # its conditional numerical reproducibility mode is on; a resumed process allocates at
    # other addresses, so without it a resumed run can differ in the last bits.
    "MKL_CBWR": "AVX2,STRICT",
    # The same bits on every x86 machine with AVX2, not only on the one a run started on: MKL
    # (above), oneDNN and ATen's own vectorised kernels otherwise each pick their code path by
    # the CPU (AVX-512 on many Intel servers, AVX2 on AMD EPYC), and the last bits of a run, a
    # resumed run or the digest corpus then depend on the machine (measured: the corpus recorded
    # on one machine failed on an AMD EPYC at the same code; ATEN_CPU_CAPABILITY=default and
    # MKL_CBWR=COMPATIBLE each change them again). A CPU without AVX2 falls back to its best path.
    "ATEN_CPU_CAPABILITY": "avx2",
    "DNNL_MAX_CPU_ISA": "AVX2",
    # OpenMP (libgomp, torch's intra-op pool) threads sleep as soon as a parallel region ends
    # instead of spinning for it: a spinning thread burns the core that another run on the
    # machine (or this run's own Prefect and MLflow threads) needs. Read when torch loads, so
    # configure_environment must run before the first `import torch`. The thread count and the
    # results are unchanged.
    "OMP_WAIT_POLICY": "PASSIVE",
}


def with_defaults(env: dict) -> dict:
    """``env`` with :data:`DEFAULTS` filled in where it sets nothing. An OMP_WAIT_POLICY exported
    empty asks for OpenMP's own default (spin a while, then sleep): it is dropped."""
    merged = {**DEFAULTS, **env}
    if merged.get("OMP_WAIT_POLICY") == "":
        del merged["OMP_WAIT_POLICY"]
    return merged


def configure_environment(verbose: bool = False, home: str | Path | None = None) -> None:
    wanted = with_defaults(dict(os.environ))
    os.environ.update(wanted)
    if "OMP_WAIT_POLICY" not in wanted:
        os.environ.pop("OMP_WAIT_POLICY", None)
    if verbose:
        os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"
    os.environ.setdefault("PREFECT_HOME", str(Path(home or Path.cwd() / ".prefect").resolve()))
    import warnings

    warnings.filterwarnings("ignore", message=".*local version label.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="mlflow")


def reread_prefect_settings() -> None:
    """Prefect read its settings (home, API, logging) from the environment it was imported in;
    a resident's child (flows/resident.py) has the client's: read them again, and set its
    logging up again from them."""
    from prefect.context import refresh_global_settings_context
    from prefect.logging.configuration import setup_logging

    refresh_global_settings_context()
    setup_logging(incremental=False)


def tie_to_parent(parent: int | None = None):
    """A ``preexec_fn`` for a child process (a Prefect server): the kernel sends it SIGTERM when
    this process dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG), so nothing is left behind;
    with ``parent`` given, the child exits at once if that parent already died. None off Linux
    (atexit still stops the child on a normal exit)."""
    if not sys.platform.startswith("linux"):
        return None

    def tie() -> None:  # pragma: no cover - runs in the child between fork and exec
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            return
        if parent is not None and os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return tie
