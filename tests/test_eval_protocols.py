"""Evaluation protocols (config section ``eval``): the label-union test sets equal per-client
copies built by hand, the averages and report modes are what their names say, every convention
is logged, the headline follows the configured one, bad values are one line, and the fast
kernels give the plain forward pass's values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.func import functional_call

from conftest import assert_resume_bit_identical, assert_trainers_agree, run_flock, tiny_config

from flockfl.experiments import validate
from flockfl.rounds import prepare, run_rounds


def cfg_of(**over):
    return validate(tiny_config(**over))


def hand_label_union(prep, params_of, clients):
    """Each client's label-union test set built explicitly from the dataset and partition (every
    test sample of a label its training data holds, rotated and relabelled as the client's own
    data), measured with a plain forward pass under ``params_of(i)``: ([C] loss, [C] acc, [C] n)."""
    from flockfl.data import load_dataset, make_partition
    from flockfl.data.clients import rotate_images

    cfg, ctx = prep.cfg, prep.ctx
    ds = load_dataset(cfg.dataset, cfg.seed, cfg.partition.num_clients)
    part = make_partition(ds, cfg)
    ctx.model.eval()
    out = []
    for i, c in enumerate(clients):
        _, y_train = ctx.data.train.client(int(c))
        perm = part.label_perm[c] if part.label_perm is not None else np.arange(ds.num_classes)
        held = np.isin(perm[ds.y_test], y_train.numpy())
        x = torch.from_numpy(np.ascontiguousarray(ds.x_test[held]))
        if part.angle[c] != 0:
            x = rotate_images(x, float(part.angle[c]))
        y = torch.from_numpy(perm[ds.y_test[held]])
        if len(y) == 0:
            out.append((0.0, 0.0, 0))
            continue
        with torch.no_grad():
            logits = functional_call(ctx.model, params_of(i), (x,))
        out.append((float(torch.nn.functional.cross_entropy(logits, y)), float((logits.argmax(-1) == y).float().mean()),
                    len(y)))
    return tuple(np.array(v) for v in zip(*out))


PARTITIONS = {
    "dirichlet": {"scheme": "dirichlet", "alpha": 0.3, "num_clients": 12},
    "rotated": {"scheme": "rotated", "num_clients": 12, "k": 4},  # four views of the test set
    "label_swap": {"scheme": "label_swap", "num_clients": 12, "k": 2},  # per-client label maps
}


@pytest.mark.parametrize("scheme", sorted(PARTITIONS))
def test_label_union_of_a_shared_model_equals_per_client_copies(tmp_path, scheme):
    from flockfl.evaluation import measure_shared

    prep = prepare(cfg_of(partition=PARTITIONS[scheme], algorithm={"name": "ifca", "k": 2, "init": "random"},
                          train={"rounds": 2}), tmp_path)
    state = run_rounds(prep)
    clients = prep.ctx.seen
    which = np.maximum(prep.algorithm.eval_assignment(state, prep.ctx)[clients], 0)
    cm = measure_shared(prep.ctx, state.models, which, clients)
    loss, acc, n = hand_label_union(prep, lambda i: {k: v[which[i]] for k, v in state.models.items()}, clients)
    got_loss, got_acc, got_n = cm["label_union"]
    np.testing.assert_array_equal(got_n, n)
    np.testing.assert_allclose(got_acc, acc, atol=1e-12)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
    assert n.sum() > prep.ctx.data.test.sizes.sum()  # the label unions overlap between clients


@pytest.mark.parametrize("model", ["mlp", "cnn_bn"])  # batched dense models; the per-client loop
def test_label_union_of_own_models_equals_per_client_copies(tmp_path, model):
    from flockfl.evaluation import measure_own

    prep = prepare(cfg_of(partition=PARTITIONS["label_swap"], model={"name": model, "hidden": 16},
                          algorithm={"name": "ditto"}, train={"rounds": 2, "eval_chunk": 5}, eval={"conventions": "all"}),
                   tmp_path)
    state = run_rounds(prep)
    clients = prep.ctx.seen
    own = prep.algorithm.own_models(state, prep.ctx, clients, np.zeros(len(clients), np.int64))
    cm = measure_own(prep.ctx, own, clients)
    loss, acc, n = hand_label_union(prep, lambda i: {k: v[i] for k, v in own.items()}, clients)
    np.testing.assert_array_equal(cm["label_union"][2], n)
    np.testing.assert_allclose(cm["label_union"][1], acc, atol=1e-12)
    np.testing.assert_allclose(cm["label_union"][0], loss, rtol=1e-5)


def test_every_convention_is_logged_and_the_headline_follows_the_configured_one(tmp_path):
    cfg = cfg_of(partition=PARTITIONS["dirichlet"], eval={"test_set": "label_union", "average": "clients"},
                 train={"rounds": 2, "eval_finetune": "final"})
    prep = prepare(cfg, tmp_path)
    state = run_rounds(prep)
    row = state.history[-1]
    for fam in ("accuracy", "accuracy_finetuned"):
        for ts in ("proportional", "label_union"):
            for avg in ("samples", "clients"):
                assert f"{fam}__{ts}__{avg}" in row
            assert f"{fam}_min__{ts}" in row and f"{fam}_p10__{ts}" in row
        assert row[fam] == row[f"{fam}__label_union__clients"]
        assert row[f"{fam}_min"] == row[f"{fam}_min__label_union"]
    assert row["loss"] == row["loss__label_union__clients"]
    # the two test sets and the two averages really differ on a Dirichlet split
    assert len({row[f"accuracy__{ts}__{avg}"] for ts in ("proportional", "label_union")
                for avg in ("samples", "clients")}) == 4
    # clients: the unweighted mean of the clients' own accuracies
    acc = prep.algorithm.evaluate(state, prep.ctx)["_client_accuracy"]
    assert row["accuracy"] == pytest.approx(float(np.mean(acc)), abs=1e-12)
    # the last row names every report mode of every convention (best_after_all_seen once everyone trained)
    for mode in ("final", "best", "mean_last"):
        assert f"accuracy__proportional__samples__{mode}" in row
    assert ("accuracy__label_union__clients__best_after_all_seen" in row) == (state.driver.all_trained_round is not None)


@pytest.mark.parametrize("name", ["fedavg", "ditto"])
def test_configured_conventions_skip_label_union_unless_it_is_the_test_set(tmp_path, name):
    base = dict(partition=PARTITIONS["dirichlet"], algorithm={"name": name}, train={"rounds": 2, "eval_finetune": "final"})
    every = run_rounds(prepare(cfg_of(**base, eval={"conventions": "all"}), tmp_path / "all")).history[-1]
    cheap = run_rounds(prepare(cfg_of(**base), tmp_path / "cheap")).history[-1]  # the default
    only = run_rounds(prepare(cfg_of(**base, eval={"conventions": "configured"}), tmp_path / "cfg")).history[-1]
    assert any("label_union" in k for k in every) and not any("label_union" in k for k in only)
    for row in (only, cheap):
        for k, v in row.items():  # everything it does measure is what the full evaluation measured
            if k.startswith(("accuracy", "loss")):
                assert v == every[k], k
    # cheap: the label union of shared models (one pass per model), not of per-client models
    assert "accuracy_finetuned__label_union__samples" in every
    assert not any(k.startswith("accuracy_finetuned") and "label_union" in k for k in cheap)
    if name == "fedavg":
        assert "accuracy__label_union__samples" in cheap
    else:  # Ditto: accuracy is the personal models', accuracy_global the shared w's
        assert "accuracy__label_union__samples" not in cheap and "accuracy_global__label_union__samples" in cheap
    lu = run_rounds(prepare(cfg_of(**base, eval={"conventions": "configured", "test_set": "label_union"}),
                            tmp_path / "lu")).history[-1]
    assert lu["accuracy"] == every["accuracy__label_union__samples"]


def test_samples_average_and_proportional_set_are_the_defaults(tmp_path):
    state = run_rounds(prepare(cfg_of(train={"rounds": 1}), tmp_path))
    row = state.history[-1]
    assert row["accuracy"] == row["accuracy__proportional__samples"]
    assert row["accuracy_p10"] == row["accuracy_p10__proportional"]
    assert state.driver.eval_protocol == {"test_set": "proportional", "average": "samples", "report": "final",
                                           "last_k": 10}


def _state(rows, all_trained=None, **proto):
    from flockfl.state import DriverRecord, ServerState

    driver = DriverRecord(eval_protocol={"test_set": "proportional", "average": "samples", "report": "final", "last_k": 2,
                                         **proto}, all_trained_round=all_trained)
    history = [{"round": r, "round_time_s": 1.0, **row} for r, row in enumerate(rows, 1)]
    return ServerState(len(rows), {"w": torch.zeros(1, 1)}, np.zeros(1, np.int64), np.zeros((0, 1), np.int64),
                       history=history, driver=driver)


ROWS = [{"accuracy": 0.5, "accuracy__proportional__samples": 0.5, "loss": 2.0}, {"sparsity": 0.1},  # round 2 not evaluated
        {"accuracy": 0.9, "accuracy__proportional__samples": 0.9, "loss": 1.0},
        {"accuracy": 0.7, "accuracy__proportional__samples": 0.7, "loss": 1.5, "accuracy_finetuned": 0.8}]


@pytest.mark.parametrize("mode,all_trained,want,round_", [
    ("final", None, 0.7, 4), ("best", None, 0.9, 3), ("mean_last", None, 0.8, 4),
    ("best_after_all_seen", 4, 0.7, 4), ("best_after_all_seen", 2, 0.9, 3)])
def test_report_modes_pick_their_round(mode, all_trained, want, round_):
    from flockfl.eval_summary import summarise

    s = summarise(_state(ROWS, all_trained, report=mode))
    assert s["metrics"]["accuracy"] == pytest.approx(want)
    assert s["metrics"]["loss"] == 1.5  # not an accuracy: the last round's
    assert s["metrics"]["accuracy_finetuned"] == 0.8  # evaluated once: that round under every mode
    assert s["protocol"] == {"test_set": "proportional", "average": "samples", "report": mode, "last_k": 2,
                             "accuracy_round": round_, "all_trained_round": all_trained}
    assert s["reports"]["proportional/samples"]["best"] == 0.9


def test_best_after_all_seen_without_every_client_trained_reports_nothing():
    from flockfl.eval_summary import summarise

    s = summarise(_state(ROWS, None, report="best_after_all_seen"))
    assert "accuracy" not in s["metrics"] and s["protocol"]["accuracy_round"] is None


def test_all_trained_round_counts_federating_clients_only():
    from flockfl.eval_summary import note_trained
    from flockfl.state import DriverRecord

    seen = np.array([0, 1, 2, 4])  # client 3 is a newcomer
    run = note_trained(DriverRecord(), np.array([0, 1]), seen, 1)
    assert run.all_trained_round is None and run.trained is not None
    run = note_trained(run, np.array([1, 2]), seen, 2)
    assert run.all_trained_round is None
    run = note_trained(run, np.array([4]), seen, 3)
    assert run == DriverRecord(all_trained_round=3)
    assert note_trained(run, np.array([0]), seen, 4).all_trained_round == 3


def test_flexcfl_round_robin_has_trained_everyone_after_n_over_k_rounds(tmp_path):
    """Round-robin selection trains 6 of 12 clients per round: all of them by round 2; the last
    row's best_after_all_seen is the best evaluated round from there."""
    cfg = cfg_of(algorithm={"name": "flexcfl", "k": 2}, train={"rounds": 3}, eval={"report": "best_after_all_seen"})
    state = run_rounds(prepare(cfg, tmp_path))
    assert state.driver.all_trained_round == 2
    key = "accuracy__proportional__samples"
    assert state.history[-1][f"{key}__best_after_all_seen"] == max(h[key] for h in state.history[1:])


def test_resume_and_both_trainers_keep_the_protocol_logs(tmp_path):
    """Trained-client tracking lives in the state: a run resumed before every client trained ends
    with the same report rows (assert_resume_bit_identical compares the last row)."""
    over = dict(algorithm={"name": "flexcfl", "k": 2}, eval={"test_set": "label_union", "report": "best_after_all_seen"},
                train={"rounds": 4, "clients_per_round": 4})  # round robin: everyone trained by round 3
    full, _ = assert_resume_bit_identical(cfg_of(**over), tmp_path / "resume", until=1)
    assert full.driver.all_trained_round == 3
    assert any(k.endswith("__best_after_all_seen") for k in full.history[-1])
    ref, vec = assert_trainers_agree(lambda e: cfg_of(**{**over, "train": {**over["train"], "engine": e}}), tmp_path / "agree")
    for k in ("accuracy", "accuracy__label_union__samples", "accuracy__proportional__clients"):
        assert ref.history[-1][k] == pytest.approx(vec.history[-1][k], abs=1e-6)


def test_personal_pruned_and_newcomer_families_have_every_convention(tmp_path):
    cfg = cfg_of(model={"name": "cnn_bn", "hidden": 16}, algorithm={"name": "fedrep", "head_epochs": 1},
                 pruning={"method": "unstructured", "acc_threshold": 0.0}, partition={"unseen_fraction": 0.25},
                 train={"rounds": 1, "clients_per_round": 4, "eval_finetune": "final"}, eval={"test_set": "label_union"})
    row = run_rounds(prepare(cfg, tmp_path)).history[-1]
    for name in ("accuracy_personal", "accuracy_pruned", "accuracy_pruned_finetuned", "accuracy_finetuned",
                 "unseen_accuracy", "unseen_accuracy_untuned"):
        assert row[name] == row[f"{name}__label_union__samples"], name
        assert f"{name}__proportional__clients" in row, name
    assert row["unseen_accuracy_min_untuned"] == row["unseen_accuracy_min_untuned__label_union"]


def test_regression_has_only_the_proportional_test_set(tmp_path):
    from flockfl.data.lsq import hetero_lsq, lsq_config
    from flockfl.errors import ConfigError
    from flockfl.rounds import prepare_data

    data, _, _ = hetero_lsq(m=4, d=5, n=10)
    raw = lsq_config({"name": "fedavg"}, 4, {"rounds": 1, "lr": 0.01})
    row = run_rounds(prepare_data(validate(raw), data)).history[-1]
    assert row["loss"] == row["loss__proportional__samples"] and "loss__proportional__clients" in row
    assert not any("label_union" in k or "accuracy" in k for k in row)
    with pytest.raises(ConfigError, match="eval.test_set: 'label_union' needs class labels"):
        run_rounds(prepare_data(validate({**raw, "eval": {"test_set": "label_union"}}), data))


# each case is a real `flockfl` process (5-13 s in the parallel suite): the fast tier runs the first,
# the full suite all of them
@pytest.mark.parametrize("setting,needle", [
    ("eval.test_set=everything", "eval.test_set"), *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("eval.average=median", "eval.average"), ("eval.report=worst", "eval.report"),
        ("eval.last_k=0", "eval.last_k"), ("eval.conventions=some", "eval.conventions")))])
def test_bad_eval_values_exit_2_with_one_line(workdir, setting, needle):
    res = run_flock(["run", "ifca_rotated_digits", "--set", setting], workdir, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert needle in res.stderr and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


@pytest.mark.slow
def test_label_union_on_a_regression_dataset_exits_2_with_one_line(workdir):
    res = run_flock(["run", "ifca_rotated_digits", "--set", "dataset.name=synthetic_linreg", "--set", "model.name=linear",
                     "--set", "partition.scheme=natural", "--set", "eval.test_set=label_union"], workdir, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "eval.test_set: 'label_union' needs class labels" in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


# ---------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("shape,kernel", [((3, 4, 24, 24), 2), ((2, 3, 9, 7), 2), ((2, 2, 12, 12), 3), ((2, 2, 12, 12), (2, 3))])
def test_strided_pooling_gives_max_pool2d_bit_for_bit(shape, kernel):
    from flockfl.engine.evaluate import strided_pooling

    x = torch.randn(shape)
    x[0, 0, 0, :4] = 1.0  # ties
    want = torch.nn.functional.max_pool2d(x, kernel)
    with strided_pooling():
        got = torch.nn.functional.max_pool2d(x, kernel)
        padded = torch.nn.functional.max_pool2d(x, 2, padding=1)  # not non-overlapping: PyTorch's own
    assert torch.equal(got, want)
    assert torch.equal(padded, torch.nn.functional.max_pool2d(x, 2, padding=1))


def test_batched_dense_models_equal_the_per_client_forward():
    from flockfl.engine.evaluate import own_outputs
    from models import build_model, init_params
    from flockfl.engine.functional import stack

    model = build_model("mlp", (1, 8, 8), 10, 16)
    params = stack([init_params(model, torch.Generator().manual_seed(i)) for i in range(5)])
    x = torch.randn(40, 1, 8, 8)
    index = [torch.arange(0, 7), torch.arange(3, 30), torch.zeros(0, dtype=torch.long), torch.arange(39, 40),
             torch.tensor([5, 2, 9])]
    outs = own_outputs(model, params, x, index)
    for i, idx in enumerate(index):
        want = functional_call(model, {k: v[i] for k, v in params.items()}, (x[idx],))
        torch.testing.assert_close(outs[i], want, rtol=1e-5, atol=1e-6)


def test_bn_statistics_are_recomputed_only_where_the_subnetwork_changed(tmp_path, monkeypatch):
    from flockfl.engine.functional import index_params
    from flockfl.stages import subfedavg as pr_module

    prep = prepare(cfg_of(model={"name": "cnn_bn", "hidden": 16}, pruning={"method": "unstructured", "acc_threshold": 0.0},
                          train={"rounds": 1}), tmp_path)
    state = run_rounds(prep)
    pr, ctx = prep.stages["pruning"], prep.ctx
    calls = []
    real = pr_module.calibrate_bn
    monkeypatch.setattr(pr_module, "calibrate_bn", lambda model, p, data, clients: (calls.append(list(clients)),
                                                                                   real(model, p, data, clients)))
    clients = ctx.seen[:4]
    params = index_params(state.models, torch.zeros(len(clients), dtype=torch.long))
    first = pr.calibrated(ctx, params, clients)
    done = len(calls)
    assert all(torch.equal(first[k], v) for k, v in pr.calibrated(ctx, params, clients).items())
    assert len(calls) == done  # nothing changed: nothing recomputed
    params["fc1.weight"][1] += 0.1  # client 1's subnetwork changed
    again = pr.calibrated(ctx, params, clients)
    assert calls[done:] == [[int(clients[1])]]
    fresh = {k: v.clone() for k, v in params.items()}
    real(ctx.model, fresh, ctx.data.train, clients)
    assert all(torch.equal(again[k], fresh[k]) for k in fresh)
    assert not math.isnan(float(again["bn1.running_var"].sum()))


def test_under_a_distribution_shift_both_test_sets_follow_the_current_data(tmp_path):
    """A shift regroups the test rows (the proportional rows take their own pass) and changes
    the labels a client holds (its label union follows its current training data)."""
    from flockfl.evaluation import measure_shared, own_cluster_metrics

    prep = prepare(cfg_of(partition=PARTITIONS["dirichlet"], shift={"kind": "swap_all", "probability": 1.0},
                          train={"rounds": 2}), tmp_path)
    state = run_rounds(prep)
    ctx = prep.ctx
    for st in prep.stages.values():
        st.sync(ctx, state)
    assert ctx.data is not ctx.base_data
    clients = ctx.seen
    zeros = np.zeros(len(clients), np.int64)
    cm = measure_shared(ctx, state.models, zeros, clients)
    loss, acc, n = hand_label_union(prep, lambda i: {k: v[0] for k, v in state.models.items()}, clients)
    np.testing.assert_array_equal(cm["label_union"][2], n)
    np.testing.assert_allclose(cm["label_union"][1], acc, atol=1e-12)
    p_loss, p_acc, p_n = own_cluster_metrics(ctx.model, state.models, zeros, ctx.data.test, clients, "classification")
    np.testing.assert_array_equal(cm["proportional"][2], p_n)
    np.testing.assert_allclose(cm["proportional"][1], p_acc, atol=1e-6)
    np.testing.assert_allclose(cm["proportional"][0], p_loss, rtol=1e-5)


@pytest.mark.parametrize("shared", [1, 2, 3])  # layers every client shares: body + personal head, + 2 personal, all
def test_a_shared_body_runs_once_and_equals_the_per_client_forward(shared):
    """FedRep/FedPer's models: the leading layers are one broadcast value, the rest per client;
    the body is computed once on the union of the rows and each client's personal layers on it
    (a one-layer head as one GEMM); any subset of clients at a time gives the same outputs."""
    from flockfl.aggregation import broadcast
    from flockfl.engine.evaluate import OwnOutputs
    from models import init_params
    from flockfl.engine.functional import stack

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 10))
    n = 6
    params = stack([init_params(model, torch.Generator().manual_seed(i)) for i in range(n)])
    layers = ["1", "3", "5"][:shared]
    one = broadcast({k: v[:1] for k, v in params.items()}, n)
    params = {k: one[k] if k.split(".")[0] in layers else v for k, v in params.items()}
    x = torch.randn(50, 1, 8, 8)
    index = [torch.arange(0, 40), torch.arange(3, 50), torch.zeros(0, dtype=torch.long), torch.arange(45, 50),
             torch.tensor([5, 2, 9, 2]), torch.arange(50)]
    run = OwnOutputs(model, params, x, index)
    assert run.x.shape[0] == 50 and run.layers == ["1", "3", "5"][shared:]  # the body ran, once
    for which in (None, np.array([4, 1]), np.array([5])):
        outs = run(which)
        for j, i in enumerate(range(n) if which is None else which):
            want = functional_call(model, {k: v[i] for k, v in params.items()}, (x[index[i]],))
            torch.testing.assert_close(outs[j], want, rtol=1e-5, atol=1e-6)


def test_own_models_reduced_in_small_groups_equal_per_client_copies(tmp_path, monkeypatch):
    """Memory holds one group of outputs (``ABSORB_ROWS``), whatever the chunk: the sums are the same."""
    from flockfl import evaluation
    from flockfl.evaluation import measure_own, row_groups

    assert [g.tolist() for g in row_groups([3, 4, 9, 1, 1], 5)] == [[0], [1], [2], [3, 4]]
    assert row_groups([], 5) == []
    prep = prepare(cfg_of(partition=PARTITIONS["rotated"], algorithm={"name": "fedrep", "head_epochs": 1},
                          train={"rounds": 2}, eval={"conventions": "all"}), tmp_path)
    state = run_rounds(prep)
    clients = prep.ctx.seen
    own = prep.algorithm.own_models(state, prep.ctx, clients, np.zeros(len(clients), np.int64))
    whole = measure_own(prep.ctx, own, clients)
    monkeypatch.setattr(evaluation, "ABSORB_ROWS", 97)
    monkeypatch.setattr(evaluation.row_groups, "__defaults__", (97,))
    grouped = measure_own(prep.ctx, own, clients)
    loss, acc, n = hand_label_union(prep, lambda i: {k: v[i] for k, v in own.items()}, clients)
    for cm in (whole, grouped):
        np.testing.assert_array_equal(cm["label_union"][2], n)
        np.testing.assert_allclose(cm["label_union"][1], acc, atol=1e-12)
        np.testing.assert_allclose(cm["label_union"][0], loss, rtol=1e-5)
        for ts in ("proportional", "label_union"):
            np.testing.assert_allclose(cm[ts][0], whole[ts][0], rtol=1e-6)


def test_clients_never_trained_take_their_personal_metrics_from_the_global_model(tmp_path):
    """Ditto: a client whose personal row was never written has the global w as its model, so
    only the written rows are measured one by one; the result is every client measured alone."""
    from flockfl.evaluation import measure_own

    prep = prepare(cfg_of(partition=PARTITIONS["dirichlet"], algorithm={"name": "ditto"},
                          train={"rounds": 1, "clients_per_round": 4, "eval_chunk": 5}, eval={"conventions": "all"}),
                   tmp_path)
    state = run_rounds(prep)
    ctx, alg = prep.ctx, prep.algorithm
    clients = ctx.seen
    written = state.algo["personal"].written(clients)
    assert 0 < written.sum() < len(clients)
    got = alg.chunk_metrics(state, ctx, clients, np.zeros(len(clients), np.int64))[""]
    want = measure_own(ctx, alg.own_models(state, ctx, clients, np.zeros(len(clients), np.int64)), clients)
    for ts in ("proportional", "label_union"):
        for a, b in zip(got[ts], want[ts]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # eval.conventions=cheap (the default): the personal models are not measured on the label
    # union, so the family drops it rather than keep the global model's numbers for the untrained
    ctx.cfg = ctx.cfg.model_copy(update={"eval": ctx.cfg.eval.model_copy(update={"conventions": "cheap"})})
    cheap = alg.chunk_metrics(state, ctx, clients, np.zeros(len(clients), np.int64))
    assert set(cheap[""].sets) == {"proportional"} and set(cheap["_global"].sets) == {"proportional", "label_union"}
    for a, b in zip(cheap[""]["proportional"], want["proportional"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
