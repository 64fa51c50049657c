"""A run directory: ``run.json`` (the config, the tracking URI, the partitions folder, when
it was made) beside the checkpoints; how a run is found again (by folder or MLflow run id),
and what makes two configs the same run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from flockfl.errors import UserError
from flockfl.files import atomic_write

RUN_FILE = "run.json"


def read_run_file(run_dir: Path) -> dict:
    p = Path(run_dir) / RUN_FILE
    return json.loads(p.read_text()) if p.exists() else {}


def write_run_file(run_dir: Path, info: dict) -> None:
    atomic_write(Path(run_dir) / RUN_FILE, json.dumps(info, indent=1, sort_keys=True).encode())


def run_key(run_dir) -> str:
    """A run directory as the key of this process's tables of runs (their core leases, their
    tracking still closing): its resolved path."""
    return str(Path(run_dir).resolve())


def run_identity(config: Optional[dict]) -> Optional[dict]:
    """What makes two configs the same run: everything but ``executor`` (where the shards train
    never changes results, so a run started locally may continue on a Dask cluster), with the
    defaults filled in (a run.json written before a key existed has that key's default)."""
    if config is None:
        return None
    try:
        from flockfl.experiments import validate

        config = validate(config).model_dump()
    except Exception:  # noqa: BLE001 - a config this code no longer accepts: compared as written
        pass
    return {k: v for k, v in config.items() if k != "executor"}


def find_run_dir(run: str, uri: Optional[str]) -> Path:
    """The run directory of ``run``: a folder holding run.json, or an MLflow run id whose
    ``flockfl.run_dir`` tag names one on this machine."""
    if (Path(run) / RUN_FILE).exists():
        return Path(run)
    from flows.tracking.store import resolve_tracking_uri

    if not all(c in "0123456789abcdef" for c in run.lower()) or len(run) < 16:
        raise UserError(f"{run!r} is neither a run directory (with run.json) nor an MLflow run id")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        found = MlflowClient(resolve_tracking_uri(uri, None)).get_run(run)
    except MlflowException:
        raise UserError(f"MLflow run {run} not found in {resolve_tracking_uri(uri, None)}; pass --tracking-uri") from None
    d = found.data.tags.get("flockfl.run_dir")
    if not d or not (Path(d) / RUN_FILE).exists():
        raise UserError(f"MLflow run {run} has no flockfl run directory on this machine ({d or 'no tag'})")
    return Path(d)
