"""MLflow tracking of experiment runs, next to the flows that use it.

Every MLflow call of a run goes through these modules, one job each:

- ``store``: the tracking URI, opening the store (one process at a time creates a new SQLite
  store), prefetching it, and making a training experiment;
- ``view``: links into the MLflow UI and flockfl's results view of an experiment's runs;
- ``names``: the names flockfl's values have in MLflow, and a run read back under flockfl's;
- ``source``: the git commit a run's code came from, as tags;
- ``tracker``: the :class:`~flows.tracking.tracker.Tracker` that creates or re-opens a run and
  logs to it;
- ``export``: the run's final models, logged and registered (idempotent across a resume);
- ``background``: the tracker's calls made in order on one background thread.

Only flows use it (experiment, sweep, report, ui, schedule, demo, rundir), so it lives in
``flows/``, the top layer; ``tasks/`` stays the Prefect tasks.
"""
