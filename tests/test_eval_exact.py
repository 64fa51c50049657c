"""Evaluation is exact: the metrics of a fixed corpus of runs equal those the evaluation
before the protocol and speed work (commit 65a4ff9) gave, to 1e-6.

``tests/eval_metrics.json`` was recorded by running :func:`corpus_metrics` on that commit
(``python tests/test_eval_exact.py --write`` records it anew: only a deliberate change of the
metrics may do that). The corpus builds its clients itself from scikit-learn's digits (no
dataset loader, no partition scheme, no model whose default may change), so only the
training and the evaluation decide its numbers; training is pinned bit for bit by the digest
corpus, so a difference here is the evaluation's.

Cases: FedAvg (one shared model, fine-tuned convention every round), IFCA (k cluster models),
APFL (personal models + the global one), FedRep (partial sharing), FlexCFL (groups with cold
clients, its global model), Sub-FedAvg unstructured pruning with BatchNorm (subnetworks with
recomputed statistics, fine-tuned), newcomers (joined and fine-tuned), and the reference trainer.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "eval_metrics.json"


def digits_clients(num_clients: int = 12, classes_per_client: int = 3, seed: int = 0):
    """Label-skewed clients of scikit-learn's digits (x/16 as 1×8×8 images): client i holds
    classes {i, i+1, …} mod 10 in train and test; each class's rows are dealt round-robin over
    its holders; ground-truth group i mod 3."""
    import torch
    from sklearn.datasets import load_digits

    from flockfl.engine.data import ClientData, Split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test = rng.random(len(y)) < 0.25
    holds = [[(i + j) % 10 for j in range(classes_per_client)] for i in range(num_clients)]

    def split(mask: np.ndarray) -> Split:
        rows: list[list[int]] = [[] for _ in range(num_clients)]
        for c in range(10):
            holders = [i for i in range(num_clients) if c in holds[i]]
            for r, idx in enumerate(np.flatnonzero(mask & (y == c))):
                rows[holders[r % len(holders)]].append(int(idx))
        idx = np.concatenate([np.sort(np.asarray(r, np.int64)) for r in rows])
        offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        return Split(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]), offsets)

    return ClientData(split(~test), split(test), np.arange(num_clients) % 3, "classification", 10, (1, 8, 8))


# every algorithm key pinned to its value at that commit, so that a later change of a default
# (a method made "as published") changes the training here by no more than it changes the keys
BASE = {
    "name": "eval-exact", "seed": 5,
    "dataset": {"name": "digits"},
    "partition": {"scheme": "natural", "num_clients": 12},
    "model": {"name": "mlp", "hidden": 16},
    "algorithm": {"name": "fedavg", "weighting": "samples"},
    "train": {"rounds": 3, "clients_per_round": 6, "local_epochs": 1, "batch_size": 16, "lr": 0.1, "momentum": 0.0,
              "engine": "vectorized", "eval_chunk": 5},
    "tracking": {"enabled": False},
}
IFCA = {"name": "ifca", "k": 2, "init": "random", "weighting": "uniform", "option": "model", "shared": "none"}

CASES: dict[str, dict] = {
    "fedavg_finetuned": {"train": {"eval_finetune": "every", "finetune_epochs": 1}},
    "ifca": {"algorithm": IFCA},
    "apfl": {"algorithm": {"name": "apfl", "weighting": "samples", "alpha": 0.5, "adaptive": True, "alpha_l2": 0.0}},
    "fedrep": {"algorithm": {"name": "fedrep", "weighting": "samples", "personal_layers": "head", "head_epochs": 1,
                             "body_epochs": 1}},
    "flexcfl": {"algorithm": {"name": "flexcfl", "weighting": "samples", "k": 2, "alpha": 20, "pretrain_steps": 50,
                              "group_init": "edc", "cold_assign": "eq8", "migration": True, "shift_detector": "code",
                              "tau_ratio": 0.2, "round_robin": True, "eta_g": 0.0, "inter_group_mode": "normalized_avg",
                              "kmeans_max_iter": 20}},
    "pruning_unstructured_bn": {"model": {"name": "cnn_bn"}, "pruning": {"method": "unstructured", "acc_threshold": 0.0},
                                "train": {"eval_finetune": "final", "finetune_epochs": 1}},
    "newcomers_ifca": {"algorithm": IFCA, "partition": {"unseen_fraction": 0.25}, "train": {"clients_per_round": 4}},
    "reference_fedavg": {"train": {"engine": "reference"}},
}


def corpus_metrics(names=None) -> dict[str, list[dict[str, float]]]:
    """Every numeric metric of every evaluated round of each case (wall times left out)."""
    import torch

    # the fixture was recorded at 2 torch threads; convolutions round differently at another
    # count (the BN case's loss moves by 3e-5 at 1 thread), so the count is pinned, not inherited
    # from whichever test ran before in the same process
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return _metrics(names)
    finally:
        torch.set_num_threads(threads)


def _metrics(names) -> dict[str, list[dict[str, float]]]:
    from flockfl.config import deep_merge
    from flockfl.experiments import validate
    from flockfl.rounds import prepare_data, run_rounds
    from models import build_model

    out = {}
    for name in names or CASES:
        cfg = validate(deep_merge(BASE, CASES[name]))
        data = digits_clients()
        model = build_model(cfg.model.name, data.input_shape, data.num_outputs, cfg.model.hidden).eval()  # as prepare's
        state = run_rounds(prepare_data(cfg, data, model))
        out[name] = [{k: float(v) for k, v in row.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith("time_s")}
                     for row in state.history]
    return out


def _recorded() -> dict:
    """The metrics recorded on a machine of this one's float arithmetic, else the first recording
    (kept per machine as the digests are: tests/digest_corpus.py, ``arithmetic``)."""
    import digest_corpus

    rec = json.loads(FIXTURE.read_text())
    return rec.get(digest_corpus.arithmetic(), rec[digest_corpus.FIRST])


RECORDED = _recorded()


@pytest.mark.parametrize("name", sorted(CASES))
def test_metrics_equal_the_recorded_evaluation(name):
    """Every metric the old evaluation reported has the same value now (the plain names follow
    the default protocol, proportional test sets and sample-weighted means, as before)."""
    now = corpus_metrics([name])[name]
    old = RECORDED[name]
    assert len(now) == len(old)
    for r, (a, b) in enumerate(zip(now, old)):
        missing = set(b) - set(a)
        assert not missing, (name, r, sorted(missing))
        for k, v in b.items():
            if math.isnan(v):
                assert math.isnan(a[k]), (name, r, k)
            else:
                assert a[k] == pytest.approx(v, rel=1e-6, abs=1e-6), (name, r, k, a[k], v)


if __name__ == "__main__" and "--write" in sys.argv:
    sys.path.insert(0, str(HERE.parent))
    import digest_corpus

    rec = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    rec[digest_corpus.arithmetic()] = corpus_metrics()
    FIXTURE.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
