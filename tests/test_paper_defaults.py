"""A registry name is the method as published (issue 19): every seed method's defaults say where
they come from (paper, thesis, official code, library, or the data), `flockfl list` shows it, IFCA
and DIFCA start as their publications do (random models, no central step before round 0), PACFL
takes the official code's configuration, and a β that only the data can set stops the run with
one line instead of quietly becoming another method."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import ROOT, last_json, run_flock, tiny_config

import flockfl.algorithms.ifca_init as ifca_init  # where IFCA's pre-training calls train_from
from flockfl.algorithms import ALGORITHMS, algorithm_table, describe, sources_table
from flockfl.algorithms.hyper import SOURCES, Hyper, declared
from flockfl.errors import ConfigError
from flockfl.experiments import validate
from flockfl.reference import read_block
from flockfl.rounds import prepare, run_rounds

SEED_METHODS = ("ifca", "ifca_oneshot", "difca", "pacfl", "flis_dc", "flis_hc", "flexcfl", "fedcluster", "fesem", "fedsc",
                "fedac", "ccfl", "fedeff")

# (method, key, default, source): the published defaults this issue fixes, and where they come from
DEFAULTS = [
    ("ifca", "init", "random", "paper"),
    ("ifca", "option", "model", "paper"),
    ("ifca", "weighting", "uniform", "paper"),
    ("difca", "init", "random", "paper"),
    ("difca", "participation", "fixed", "paper"),
    ("difca", "gossip_weighting", "uniform", "paper"),
    ("difca", "partners", 10, "library"),
    ("pacfl", "signature", "per_class", "code"),
    ("pacfl", "measure", "official_min_pairwise", "code"),
    ("pacfl", "linkage", "weighted", "code"),
    ("pacfl", "p", 3, "code"),
    ("pacfl", "cut", "beta", "code"),
    ("pacfl", "beta", None, "data"),
    ("flis_dc", "beta", None, "data"),
    ("flis_dc", "server_data_size", 2500, "thesis"),
    ("flis_dc", "select_by", "test_loss", "thesis"),
    ("flis_dc", "similarity", "cosine_sum", "code"),
    ("flis_hc", "beta", None, "data"),
    ("flexcfl", "alpha", 20, "paper"),
    ("flexcfl", "pretrain_steps", 50, "code"),
    ("flexcfl", "eta_g", 0.0, "paper"),
    ("fesem", "legacy_first_update_only", False, "paper"),
    ("fesem", "migration", False, "paper"),
    ("fedac", "mu", 0.01, "library"),
]


def test_every_key_of_every_seed_method_says_where_its_default_comes_from():
    for name in SEED_METHODS:
        for h in declared(ALGORITHMS[name]).values():
            assert h.source in SOURCES, f"{name}.{h.name} has no source"
            if h.source == "data":  # the data sets it: no default, and the note gives the published values
                assert h.default is None and h.note, f"{name}.{h.name}"


# issue 20's clustered and personalised baselines, and the repositories their `code` defaults are read from
BASELINES = ("cfl", "cfl-pacfl", "lg_fedavg", "fedper", "fedrep", "fedbabu", "fedbn", "ditto", "apfl", "perfedavg",
             "pfedme")
REPOSITORIES = ("felisat/clustered-federated-learning", "MMorafah/PACFL", "pliang279/LG-FedAvg", "litian96/ditto",
                "lgcollins/FedRep", "jhoon-oh/FedBABU", "CharlieDinh/pFedMe", "MLOPTPSU/FedTorch", "med-air/FedBN",
                "TsingZ0/PFLlib", "KarhouTam/FL-bench")


def test_every_key_of_every_personalised_baseline_says_where_its_default_comes_from():
    """Each baseline's keys (shared ones such as ``weighting`` and the partition keys included)
    record a source; a default read from code names the repository (the official one, or PFLlib
    or FL-bench where those were used), and each baseline is in docs' sources table."""
    listed = {line.split("|")[1].strip(" `") for line in sources_table().splitlines()[2:]}
    for name in BASELINES:
        assert name in listed, f"{name} is missing from the sources table"
        for h in declared(ALGORITHMS[name]).values():
            assert h.source in SOURCES, f"{name}.{h.name} has no source"
            if h.source == "data":
                assert h.default is None and h.note, f"{name}.{h.name}"
            if h.source == "code":
                assert any(repo in h.note for repo in REPOSITORIES), f"{name}.{h.name}: the note names no repository"
            if h.source != "paper":  # which script, table or library made the choice
                assert h.note, f"{name}.{h.name} says {h.source} but not where"


def test_a_source_outside_the_list_or_a_data_key_with_a_default_is_refused():
    with pytest.raises(ValueError, match="source 'folklore'"):
        Hyper("x", 1, "m", source="folklore")
    with pytest.raises(ValueError, match="has no default"):
        Hyper("x", 1, "m", source="data")


@pytest.mark.parametrize("name,key,default,source", DEFAULTS, ids=[f"{n}.{k}" for n, k, _, _ in DEFAULTS])
def test_the_published_defaults_and_their_sources(name, key, default, source):
    h = declared(ALGORITHMS[name])[key]
    assert (h.default, h.source) == (default, source)
    row = {r["key"]: r for r in describe(name)["hyperparameters"]}[f"algorithm.{key}"]
    assert (row["default"], row["source"], row["source_note"]) == (default, source, h.note)


def test_flock_list_prints_the_source_of_every_default(workdir):
    res = run_flock(["list", "ifca", "--json"], workdir, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = {r["key"]: r for r in last_json(res.stdout)["hyperparameters"]}
    assert rows["algorithm.init"]["default"] == "random" and rows["algorithm.init"]["source"] == "paper"
    assert rows["algorithm.pretrain_embedding"]["source"] == "library"


def test_flock_list_text_has_a_source_column_with_the_note(workdir):
    """The table ``flockfl list ALGORITHM`` prints (flows/listing.py's ``_print_algorithm``) shows each
    default's source and, after the meaning, which value or script it is."""
    text = run_flock(["list", "pacfl"], workdir, timeout=120)
    assert text.returncode == 0, text.stderr
    lines = {line.split()[0]: line for line in text.stdout.splitlines() if line.strip().startswith("algorithm.")}
    assert " code " in lines["algorithm.measure"] and "official_min_pairwise" in lines["algorithm.measure"]
    assert " data " in lines["algorithm.beta"] and "4.9" in lines["algorithm.beta"]
    assert " library " in lines["algorithm.gap_ratio"]


def test_the_docs_tables_name_the_sources():
    table = algorithm_table()
    assert "`init` (random, paper)" in table and "`beta` (set it, data)" in table
    rows = [line for line in sources_table().splitlines() if line.startswith("| `pacfl` | `measure`")]
    assert rows == ["| `pacfl` | `measure` | `official_min_pairwise` | code | "
                    f"{declared(ALGORITHMS['pacfl'])['measure'].note} |"]
    listed = {line.split("|")[1].strip(" `") for line in sources_table().splitlines()[2:]}
    assert set(SEED_METHODS) <= listed


def test_docs_sources_table_is_generated_from_the_declarations():
    block = read_block((ROOT / "docs" / "algorithms.md").read_text(), "default-sources")
    assert block is not None, "docs/algorithms.md lost its <!-- default-sources:start/end --> markers"
    assert block == sources_table(), "docs/algorithms.md's sources table is stale: run `python -m flockfl.reference`"


# ---------------------------------------------------------------------- β: the data sets it


@pytest.mark.parametrize("name", ["pacfl", "flis_dc", "flis_hc"])
def test_an_unset_beta_is_a_one_line_error_naming_the_key_and_the_published_values(name):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": name}))
    msg = str(err.value)
    assert msg.startswith(f"config error: algorithm.beta: {name} has no published default for β") and "\n" not in msg
    assert ("4.9" if name == "pacfl" else "0.5 on FMNIST") in msg and "set algorithm.beta" in msg


# a real `flockfl` process each (5-18 s in the parallel suite): the fast tier runs PACFL's
@pytest.mark.parametrize("name", ["pacfl", pytest.param("flis_hc", marks=pytest.mark.slow)])
def test_the_cli_stops_with_exit_2_and_one_line_when_beta_is_unset(workdir, name):
    raw = tiny_config(name="no-beta", algorithm={"name": name})
    (workdir / "no_beta.yaml").write_text(yaml.safe_dump(raw))
    res = run_flock(["run", "no_beta.yaml"], workdir, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"flockfl: error: config error: algorithm.beta: {name} has no published default")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert not (workdir / "runs").exists()  # nothing ran


def test_pacfl_runs_with_beta_with_k_or_with_the_named_largest_gap_rule_and_refuses_both():
    for algo in ({"beta": 5.0}, {"k": 2}, {"cut": "largest_gap"}):
        validate(tiny_config(algorithm={"name": "pacfl", **algo}))
    for algo in ({"cut": "largest_gap", "beta": 5.0}, {"cut": "largest_gap", "k": 2}):
        with pytest.raises(ConfigError, match=r"^config error: algorithm.cut: largest_gap picks the cut itself"):
            validate(tiny_config(algorithm={"name": "pacfl", **algo}))


def test_pacfl_cuts_at_beta_on_the_official_measure(tmp_path):
    """The default configuration: the code's min pairwise angle, cut at the given β (not at a gap)."""
    from flockfl import clustering

    prep = prepare(validate(tiny_config(algorithm={"name": "pacfl", "beta": 10.0})), tmp_path)
    state = run_rounds(prep, until=1)
    prox = state.algo["matrices"]["pacfl_proximity"].numpy()
    sigs = prep.algorithm.signatures(prep.ctx, prep.ctx.seen)
    np.testing.assert_allclose(prox, clustering.proximity_matrix(sigs, "official_min_pairwise"))
    assert float(state.algo["beta_used"]) == 10.0
    expected = clustering.hierarchical_clusters(prox, threshold=10.0, linkage="weighted")
    np.testing.assert_array_equal(state.assignments[prep.ctx.seen], expected)
    assert state.k == 2  # on the tiny rotated digits this β separates the two rotations


# ---------------------------------------------------------------------- IFCA and DIFCA start at random


class Recorder:
    """Stands in for ``train_from`` in ifca_init.py: records every pre-training, then trains."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, ctx, start, clients, **kw):
        self.calls.append((kw.get("stream"), len(clients)))
        return self.real(ctx, start, clients, **kw)


@pytest.mark.parametrize("name", ["ifca", "difca"])
def test_no_client_trains_or_uploads_before_round_0_by_default(tmp_path, monkeypatch, name):
    """IFCA (the paper) and DIFCA (seed 002: the server publishes k models and only listens) have
    no central step: nobody pre-trains, nothing is uploaded or clustered before round 0."""
    rec = Recorder(ifca_init.train_from)
    monkeypatch.setattr(ifca_init, "train_from", rec)
    cfg = validate(tiny_config(algorithm={"name": name, "k": 2}, train={"rounds": 2}))
    prep = prepare(cfg, tmp_path)
    assert not prep.algorithm.has_pre_federation()
    state = run_rounds(prep)
    assert rec.calls == []
    assert "pre_federation" not in state.meta and "pretrain_clients" not in state.algo
    if name == "difca":  # round 0: the k published models go down, only token holders' models come up
        per_model = prep.algorithm.model_bytes(state)
        first = state.history[0]
        assert first["bytes_down"] == cfg.train.clients_per_round * 2 * per_model
        assert first["bytes_up"] <= 2 * per_model


@pytest.mark.parametrize("name", ["ifca", "difca"])
def test_the_k_means_start_is_an_option_with_a_central_step(tmp_path, monkeypatch, name):
    """"IFCA + k-means start": a cohort pre-trains and uploads before round 0 (the same check as
    above, failing as it should)."""
    rec = Recorder(ifca_init.train_from)
    monkeypatch.setattr(ifca_init, "train_from", rec)
    cfg = validate(tiny_config(algorithm={"name": name, "k": 2, "init": "pretrain_kmeans"}, train={"rounds": 1}))
    prep = prepare(cfg, tmp_path)
    assert prep.algorithm.has_pre_federation()
    state = run_rounds(prep)
    assert [stream for stream, _ in rec.calls] == ["pretrain"]
    assert state.driver.pre_federation["bytes_up"] > 0


def test_the_default_ifca_start_is_k_independent_random_models(tmp_path):
    cfg = validate(tiny_config(algorithm={"name": "ifca", "k": 3}))
    prep = prepare(cfg, tmp_path)
    models = prep.algorithm.init_state(prep.ctx).models
    direct = prep.algorithm.random_models(prep.ctx)
    assert all(bool((models[k] == direct[k]).all()) for k in models)
    first = next(iter(models.values()))
    assert not bool((first[0] == first[1]).all()) and not bool((first[1] == first[2]).all())


def test_describe_is_json_serialisable_with_the_sources():
    for name in SEED_METHODS:
        json.dumps(describe(name))
