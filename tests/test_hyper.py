"""Algorithm-owned hyper-parameters: declarations, validation at load time, algorithm switching,
`flockfl list ALGORITHM`, and README's generated table."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, tiny_config

from flockfl.algorithms import ALGORITHMS, algorithm_table, describe
from flockfl.algorithms.hyper import declared
from flockfl.errors import ConfigError
from flockfl.experiments import validate


def test_every_algorithm_declares_a_paper_and_documented_keys():
    for name, cls in ALGORITHMS.items():
        assert cls.paper, name
        for h in declared(cls).values():
            assert h.meaning, f"{name}.{h.name}"
            if h.default is not None:  # every default passes its own constraint
                assert h.check(h.default, name) == h.default


def test_defaults_are_filled_in_and_dumped():
    cfg = validate(tiny_config(algorithm={"name": "pacfl", "beta": 5.0}))  # β has no default: the data sets it
    hyper = cfg.algorithm.hyper()
    assert hyper["p"] == 3 and hyper["measure"] == "official_min_pairwise" and hyper["k"] is None
    assert cfg.model_dump()["algorithm"]["linkage"] == "weighted"


def test_an_integer_key_takes_an_integral_float_and_a_real_key_an_int():
    cfg = validate(tiny_config(algorithm={"name": "pacfl", "p": 2.0, "beta": 10}))
    assert cfg.algorithm.p == 2 and isinstance(cfg.algorithm.p, int) and cfg.algorithm.beta == 10.0


def test_a_foreign_key_names_the_algorithms_that_take_it():
    with pytest.raises(ConfigError, match=r"algorithm.mu: fedavg does not take 'mu'; it is a hyper-parameter of "
                                          r"fedac, fednova, fedprox"):
        validate(tiny_config(algorithm={"name": "fedavg", "mu": 0.1}))
    with pytest.raises(ConfigError, match=r"algorithm.bogus: unknown key for pacfl; it takes"):
        validate(tiny_config(algorithm={"name": "pacfl", "bogus": 1}))


# every key this issue adds, with a bad value and the start of its one-line error
NEW_KEYS_BAD = [
    ("pacfl", "p", 0), ("pacfl", "p", 1.5), ("pacfl", "signature", "rows"), ("pacfl", "measure", "cosine"),
    ("pacfl", "beta", -1), ("pacfl", "beta", "wide"), ("pacfl", "k", 0), ("pacfl", "linkage", "ward"),
    ("pacfl", "newcomer_mode", "merge"),
    ("flis_dc", "server_data_size", 0), ("flis_dc", "beta", 1.5), ("flis_dc", "outputs", "logits"),
    ("flis_dc", "similarity", "l2"), ("flis_dc", "select_by", "luck"), ("flis_dc", "auto_window", 0),
    ("flis_dc", "auto_window", "all"),
    ("flis_hc", "beta", -0.1), ("flis_hc", "linkage", "ward"), ("flis_hc", "server_data_size", True),
    ("fedsc", "k", 0), ("fedsc", "schedule", "parallel"), ("fedsc", "order", "reverse"), ("fedsc", "server_lr", 0),
]


@pytest.mark.parametrize("algorithm,key,value", NEW_KEYS_BAD, ids=[f"{a}.{k}={v}" for a, k, v in NEW_KEYS_BAD])
def test_bad_values_of_new_keys_are_one_line_errors(algorithm, key, value):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(algorithm={"name": algorithm, key: value}, partition={"server_holdout": 50}))
    msg = str(err.value)
    assert msg.startswith(f"config error: algorithm.{key}: {value!r} is not allowed for {algorithm}; allowed: ")
    assert "\n" not in msg


NEW_CONFIG_KEYS_BAD = [
    ({"partition": {"unseen_fraction": 1.0}}, "partition.unseen_fraction"),
    ({"partition": {"unseen_fraction": -0.1}}, "partition.unseen_fraction"),
    ({"partition": {"server_holdout": -1}}, "partition.server_holdout"),
    ({"partition": {"rho": 0}}, "partition.rho"),
    ({"partition": {"rho": 120}}, "partition.rho"),
    ({"partition": {"sc_p": 0}}, "partition.sc_p"),
    ({"partition": {"sc_clusters": 0}}, "partition.sc_clusters"),
    ({"partition": {"sc_threshold": 0}}, "partition.sc_threshold"),
    ({"partition": {"sc_linkage": "ward"}}, "partition.sc_linkage"),
    ({"partition": {"samples_per_client": 0}}, "partition.samples_per_client"),
    ({"partition": {"scheme": "sc_magic"}}, "partition.scheme"),
    ({"dataset": {"sources": ["cifar10"]}}, "dataset.sources"),
    ({"train": {"finetune_epochs": -1}}, "train.finetune_epochs"),
    ({"train": {"eval_finetune": "sometimes"}}, "train.eval_finetune"),
    ({"algorithm": {"name": "flis_dc", "server_data_size": 100}, "partition": {"server_holdout": 10}},
     "partition.server_holdout: flis_dc needs 100 server samples"),
]


@pytest.mark.parametrize("over,needle", NEW_CONFIG_KEYS_BAD, ids=[n[:40] for _, n in NEW_CONFIG_KEYS_BAD])
def test_bad_values_of_new_config_keys_are_one_line_errors(over, needle):
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**over))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_server_holdout_follows_the_algorithm_unless_set():
    flis = {"name": "flis_hc", "server_data_size": 40, "beta": 0.5}
    assert validate(tiny_config(algorithm=flis)).partition.server_holdout == 40
    assert validate(tiny_config(algorithm={"name": "fedavg"})).partition.server_holdout == 0
    fair = validate(tiny_config(algorithm={"name": "fedavg"}, partition={"server_holdout": 40}))
    assert fair.partition.server_holdout == 40  # the same partition as FLIS's, for a fair table


def test_describe_lists_paper_keys_and_stages():
    d = describe("pacfl")
    assert "2209.10526" in d["paper"]
    assert "pre_federation" in d["stages"] and "admit_newcomers" in d["stages"]
    keys = {h["key"]: h for h in d["hyperparameters"]}
    assert keys["algorithm.beta"]["symbol"] == "β" and keys["algorithm.p"]["default"] == 3
    assert describe("fedavg")["stages"] == []


def test_docs_algorithm_table_is_generated_from_the_declarations():
    doc = (ROOT / "docs" / "algorithms.md").read_text()
    block = re.search(r"<!-- algorithms:start -->\n(.*?)\n<!-- algorithms:end -->", doc, re.S)
    assert block, "docs/algorithms.md lost its generated algorithm table markers"
    assert block.group(1) == algorithm_table(), \
        "docs/algorithms.md's algorithm table is stale: run `python -m flockfl.reference`"
