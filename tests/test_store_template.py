"""A new SQLite MLflow store starts as a copy of this machine's empty schema (flows/tracking/store.py
``_copy_schema``): the store it gives is the store MLflow makes itself (the same tables, indexes,
Alembic revision and Default experiment), the migrations run once per MLflow version instead of
once per store, and a template that cannot be used leaves MLflow to create the schema as before."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest


def _clauses(sql):
    """A CREATE statement's clauses as a set: MLflow's own migrations, run twice in one process,
    write one table's CHECK constraints in different orders."""
    return None if sql is None else frozenset(line.strip().rstrip(",").strip() for line in sql.splitlines())


def _schema(db: Path) -> dict:
    """What a store is made of: every table, index and trigger with its SQL's clauses, the
    Alembic revision, the pragmas a file keeps, and its experiments (times left out)."""
    con = sqlite3.connect(db)
    try:
        return {
            "master": sorted(((t, n, tbl, _clauses(sql)) for t, n, tbl, sql in
                              con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")),
                             key=lambda r: (r[0], r[1])),
            "alembic": con.execute("SELECT version_num FROM alembic_version").fetchall(),
            "pragmas": [con.execute(f"PRAGMA {p}").fetchall() for p in ("journal_mode", "user_version", "page_size",
                                                                      "auto_vacuum", "encoding")],
            "experiments": con.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage, workspace "
                                       "FROM experiments").fetchall(),
        }
    finally:
        con.close()


@pytest.fixture
def fresh_store(monkeypatch, tmp_path):
    """open_store on a new database, with the template at ``template`` (None: off)."""
    from flows.tracking import store

    monkeypatch.chdir(tmp_path)

    def open_new(name: str, template):
        monkeypatch.setenv(store.TEMPLATE_ENV, str(template) if template is not None else "off")
        db = tmp_path / name
        assert not db.exists()
        return store.open_store(f"sqlite:///{db}"), db

    return open_new


def test_a_store_copied_from_the_template_is_the_store_mlflow_makes(fresh_store, tmp_path):
    template = tmp_path / "cache" / "schema.db"
    _, own = fresh_store("own.db", None)  # MLflow's own migrations
    assert not template.exists()
    _, first = fresh_store("first.db", template)  # builds the template, then copies it
    assert template.is_file()
    client, copied = fresh_store("copied.db", template)  # a copy of the template built before
    # the template holds the schema and no row: MLflow adds the Default experiment to each copy
    with sqlite3.connect(template) as con:
        assert con.execute("SELECT COUNT(*) FROM experiments").fetchone() == (0,)
    own_schema = _schema(own)
    assert own_schema["experiments"] == [(0, "Default", str(tmp_path / "mlruns" / "0"), "active", "default")]
    assert _schema(first) == own_schema
    assert _schema(copied) == own_schema
    # and it works as a store: an experiment, a run, a registered model
    exp = client.create_experiment("e")
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "acc", 0.5)
    client.set_terminated(run.info.run_id)
    client.create_registered_model("m")
    assert client.get_run(run.info.run_id).data.metrics == {"acc": 0.5}
    assert [m.name for m in client.search_registered_models()] == ["m"]
    assert not list(tmp_path.glob("*.flockfl-new"))  # no copy left half-way


def test_a_template_that_is_not_a_database_leaves_mlflow_to_create_the_store(fresh_store, tmp_path):
    bad = tmp_path / "bad-template.db"
    bad.write_bytes(b"not a database")
    client, db = fresh_store("store.db", bad)
    _, own = fresh_store("own.db", None)
    assert _schema(db) == _schema(own)
    assert client.get_experiment("0").name == "Default"
    assert bad.read_bytes() == b"not a database"  # not flockfl's to repair: it is left as found
