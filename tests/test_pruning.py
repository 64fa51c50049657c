"""Sub-FedAvg pruning (thesis Chapter 4, spec §2): magnitude masks, the masked mean by hand,
the §2.8 communication table, parameter counts, channel ownership, end-to-end sparsity,
composition with five algorithms, both trainers, bit-identical resume, and one-line errors
for every new key."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_resume_bit_identical, assert_trainers_agree, run_flock, spy, tiny_config

from flockfl.experiments import validate
from flockfl.engine import LocalSpec, TrainResult, train_cohort, train_reference
from flockfl.engine.functional import stack
from flockfl.rng import torch_generator
from flockfl.rounds import prepare, run_rounds
from flockfl.eval_summary import summarise
from flockfl.stages.masks import hamming, magnitude_masks, thesis_comm_bytes
from flockfl.stages.pruning import Pruning
from models import build_model, init_params


def cfg_of(pruning=None, algo=None, model="mlp", partition=None, curriculum=None, **train):
    return validate(tiny_config(
        pruning=pruning or {}, algorithm=algo or {"name": "fedavg"}, curriculum=curriculum or {},
        model={"name": model, "hidden": 16},
        partition=partition or {"scheme": "dirichlet", "alpha": 0.5, "num_clients": 8},
        train={"rounds": 3, "clients_per_round": 4, "batch_size": 16, "eval_finetune": "off", "threads": 1, **train}))


EAGER = {"acc_threshold": 0.0, "mask_threshold": 0.0, "channel_threshold": 0.0}  # prune at every chance


# ---------------------------------------------------------------------- 1. magnitude masks


@pytest.mark.parametrize("seed", range(4))
def test_magnitude_masks_remove_the_smallest_alive_entries_and_never_revive(seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(5, 7, 9, generator=g)
    alive = torch.rand(5, 7, 9, generator=g) > 0.4
    alive[4] = False  # a client with nothing left
    alive[4, 0, 0] = True
    share = np.array([0.1, 0.5, 0.0, 0.999, 1.0])
    out = magnitude_masks(values, alive, share)
    assert out.dtype == torch.bool and out.shape == alive.shape
    assert not (out & ~alive).any()  # never revives
    for i in range(5):
        n_alive = int(alive[i].sum())
        removed = alive[i] & ~out[i]
        assert int(removed.sum()) == math.floor(share[i] * n_alive)
        if removed.any() and out[i].any():  # the removed are the smallest |value| among the alive
            assert values[i][removed].abs().max() <= values[i][out[i]].abs().min()
    kept = magnitude_masks(values, alive, share, keep_one=True)
    for i in range(5):
        assert int(kept[i].sum()) >= min(1, int(alive[i].sum()))
        assert int((alive[i] & ~kept[i]).sum()) == min(math.floor(share[i] * int(alive[i].sum())), int(alive[i].sum()) - 1)
    assert int(kept[4].sum()) == 1 and int(out[4].sum()) == 0
    # applied again, the pruned stay pruned whatever their value now
    again = magnitude_masks(torch.randn(5, 7, 9, generator=g) * 100, out, np.full(5, 0.2))
    assert not (again & ~out).any()


def test_magnitude_masks_break_ties_by_the_lower_index():
    values = torch.tensor([[1.0, 1.0, 1.0, 2.0, 1.0]])
    out = magnitude_masks(values, torch.ones(1, 5, dtype=torch.bool), np.array([0.4]))
    assert out.tolist() == [[False, False, True, True, True]]


def test_hamming_is_the_share_of_differing_entries():
    a = torch.tensor([True, False, True, True])
    assert hamming(a, torch.tensor([True, True, False, True])) == 0.5
    assert hamming(a, a) == 0.0 and hamming(torch.zeros(0), torch.zeros(0)) == 0.0


# ---------------------------------------------------------------------- 2. the masked mean by hand


def _hand_setup(tmp_path, weighting):
    cfg = cfg_of({"method": "unstructured"}, {"name": "fedavg", "weighting": weighting})
    prep = prepare(cfg, tmp_path)
    state = prep.algorithm.init_state(prep.ctx)
    g = torch.Generator().manual_seed(0)
    clients = np.array([1, 4, 6])
    params = {k: torch.randn(3, *v.shape[1:], generator=g) for k, v in state.models.items()}
    return prep, state, clients, params, g


def _result(clients, params, masks, sizes):
    return TrainResult(clients, params, np.asarray(sizes), np.ones(3, np.int64), np.zeros(3),
                       {"prune_weights": masks, "prune_channels": {}, "prune_masks": {k: v.float() for k, v in masks.items()}})


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_masked_aggregation_by_hand(tmp_path, weighting):
    prep, state, clients, params, g = _hand_setup(tmp_path, weighting)
    pr, alg = prep.stages["pruning"], prep.algorithm
    assert pr.unstructured == ["1.weight", "3.weight"]  # the mlp's two weight matrices; biases never pruned
    masks = {k: torch.rand(3, *params[k].shape[1:], generator=g) > 0.5 for k in pr.unstructured}
    masks["1.weight"][:, 0, :5] = False  # entries no client keeps
    masks["3.weight"][:, :, 0] = torch.tensor([True, False, False]).reshape(3, 1)  # one keeper
    sizes = np.array([10, 30, 60])
    # the clients' pruned entries hold garbage: the masked mean must ignore it
    result = _result(clients, params, masks, sizes)
    assign = np.zeros(3, np.int64)
    new = alg.aggregate(state, prep.ctx, None, pr.fill(alg, state, result, assign), assign)
    w = np.ones(3) if weighting == "uniform" else sizes.astype(float)
    w_t = torch.from_numpy(w).double().reshape(3, 1, 1)
    for k, v in params.items():
        if k in masks:
            m = masks[k].double()
            den = (w_t * m).sum(0)
            want = torch.where(den > 0, (w_t * m * v.double()).sum(0) / den.clamp_min(1e-30), state.models[k][0].double())
        else:  # biases: the plain weighted mean
            wb = torch.from_numpy(w / w.sum()).double().reshape(3, *([1] * (v.dim() - 1)))
            want = (wb * v.double()).sum(0)
        torch.testing.assert_close(new.models[k][0].double(), want, rtol=1e-5, atol=1e-6)
    # an entry no client keeps is the server's previous value (to float32 rounding of the weighted sum)
    torch.testing.assert_close(new.models["1.weight"][0][0, :5], state.models["1.weight"][0][0, :5], rtol=1e-6, atol=0)
    torch.testing.assert_close(new.models["3.weight"][0][:, 0], params["3.weight"][0][:, 0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_all_ones_masks_give_plain_fedavg(tmp_path, weighting):
    prep, state, clients, params, _ = _hand_setup(tmp_path, weighting)
    pr, alg = prep.stages["pruning"], prep.algorithm
    ones = {k: torch.ones(3, *params[k].shape[1:], dtype=torch.bool) for k in pr.unstructured}
    result = _result(clients, params, ones, [10, 30, 60])
    assign = np.zeros(3, np.int64)
    masked = alg.aggregate(state, prep.ctx, None, pr.fill(alg, state, result, assign), assign)
    plain = alg.aggregate(state, prep.ctx, None, result, assign)
    for k in params:
        torch.testing.assert_close(masked.models[k], plain.models[k], rtol=1e-6, atol=1e-7)
    if weighting == "uniform":
        for k, v in params.items():
            torch.testing.assert_close(plain.models[k][0], v.mean(0), rtol=1e-6, atol=1e-7)


def test_masked_mean_is_per_cluster(tmp_path):
    """Two models (IFCA-like): each cluster averages over its own keepers, and an entry none of
    a cluster's members keeps stays at that cluster's previous value."""
    prep, state, clients, params, g = _hand_setup(tmp_path, "uniform")
    pr, alg = prep.stages["pruning"], prep.algorithm
    two = {k: torch.cat([v, v + 1.0]) for k, v in state.models.items()}
    state = state.replace(models=two)
    masks = {k: torch.rand(3, *params[k].shape[1:], generator=g) > 0.5 for k in pr.unstructured}
    masks["1.weight"][0, 0, 0], masks["1.weight"][2, 0, 0], masks["1.weight"][1, 0, 0] = False, False, True
    assign = np.array([0, 1, 0])
    new = alg.aggregate(state, prep.ctx, None, pr.fill(alg, state, _result(clients, params, masks, [5, 5, 5]), assign), assign)
    assert float(new.models["1.weight"][0][0, 0]) == float(two["1.weight"][0][0, 0])  # cluster 0: no keeper
    assert float(new.models["1.weight"][1][0, 0]) == pytest.approx(float(params["1.weight"][1][0, 0]))
    m = masks["3.weight"][[0, 2]].double()
    v = params["3.weight"][[0, 2]].double()
    want = torch.where(m.sum(0) > 0, (m * v).sum(0) / m.sum(0).clamp_min(1), two["3.weight"][0].double())
    torch.testing.assert_close(new.models["3.weight"][0].double(), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- 3. the §2.8 table


def test_thesis_comm_bytes_reproduces_the_spec_table():
    cifar = [round(thesis_comm_bytes(62_006, p, 500, 10) / 1e9, 2) for p in (0.0, 0.3, 0.5, 0.7)]
    assert cifar == [2.48, 2.12, 1.88, 1.64]
    c100 = [round(thesis_comm_bytes(69_656, p, 500, 10) / 1e9, 2) for p in (0.3, 0.5, 0.7)]
    assert c100 == [2.38, 2.11, 1.84]
    # MNIST/EMNIST, by hand: 300·10/8 · 21,840 · (32 + 32(1 − p) + p) bytes
    exact = [thesis_comm_bytes(21_840, p, 300, 10) for p in (0.0, 0.3, 0.5, 0.7)]
    assert exact == pytest.approx([524_160_000, 447_993_000, 397_215_000, 346_437_000], rel=1e-12, abs=0)
    # the printed MB figures (524.16 / 448 / 397.21 / 346.43) are these to within the printed 0.01 MB
    # (447.993 and 346.437 do not round to 448.00 and 346.43: the thesis's rounding, not the formula)
    for got, printed in zip(exact, (524.16, 448.0, 397.21, 346.43)):
        assert abs(got / 1e6 - printed) < 0.01
    assert exact[0] / 1e6 == 524.16
    assert thesis_comm_bytes(1000, 0.25, 1, 1) == (32 * 1000 + 32 * 750 + 250) / 8


# ---------------------------------------------------------------------- 4. parameter counts


def _counts(model):
    named = dict(model.named_parameters())
    plain = sum(p.numel() for n, p in named.items() if not n.startswith("bn"))
    bn = sum(p.numel() for n, p in named.items() if n.startswith("bn"))
    return plain, bn


def test_parameter_counts_of_the_thesis_models():
    plain, bn = _counts(build_model("cnn_bn", (1, 28, 28), 10))
    assert plain == 21_840 and bn == 2 * 2 * (10 + 20)  # γ, β, mean, var of 10 + 20 channels
    plain, bn = _counts(build_model("lenet5_bn", (3, 32, 32), 10))
    assert plain == 62_006 and bn == 4 * (6 + 16)
    assert _counts(build_model("lenet5_bn", (3, 32, 32), 100))[0] == 69_656  # CIFAR-100's |W|
    # the BN statistics are entries of the parameter dict that no trainer steps
    model = build_model("cnn_bn", (1, 28, 28), 10)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"}


# ---------------------------------------------------------------------- 5. channel ownership


@pytest.mark.parametrize("method", ["structured", "hybrid"])
@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8)], ids=["28x28", "digits"])
def test_full_masks_follow_each_channel(method, shape):
    model = build_model("cnn_bn", shape, 10)
    pr = Pruning(cfg_of({"method": method}, model="cnn_bn"), model)
    s = model.flat_hw
    assert s == (16 if shape[1] == 28 else 4)
    weights = {k: torch.ones(1, *pr.shapes[k], dtype=torch.bool) for k in pr.unstructured}
    assert set(weights) == ({"fc1.weight", "fc2.weight"} if method == "hybrid" else set())
    ch = {"bn1": torch.ones(1, 10, dtype=torch.bool), "bn2": torch.ones(1, 20, dtype=torch.bool)}
    ch["bn1"][0, 3] = False
    ch["bn2"][0, 7] = False
    full = pr.full_masks(weights, ch)
    want = {k: torch.ones(pr.shapes[k]) for k in full}
    for name in ("conv1.weight", "conv1.bias", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var"):
        want[name][3] = 0
    want["conv2.weight"][:, 3] = 0
    for name in ("conv2.weight", "conv2.bias", "bn2.weight", "bn2.bias", "bn2.running_mean", "bn2.running_var"):
        want[name][7] = 0
    want["fc1.weight"][:, 7 * s:(7 + 1) * s] = 0
    assert set(full) == set(want)
    for k in full:
        torch.testing.assert_close(full[k][0], want[k], rtol=0, atol=0, msg=k)
    # the unstructured fc mask multiplies in (hybrid)
    if method == "hybrid":
        weights["fc1.weight"][0, 0, 0] = False
        assert float(pr.full_masks(weights, ch)["fc1.weight"][0, 0, 0]) == 0.0
    # the fc1 columns of a channel are the ones its activations feed (channel-major flatten): with the
    # channel's γ = β = 0 its pooled activations, fc1's inputs 7·s … 8·s − 1, are 0
    model.eval()
    feat = {}
    model.fc1.register_forward_hook(lambda m, i, o: feat.update(inp=i[0]))
    with torch.no_grad():
        x = torch.randn(2, *shape)
        p = {k: v * full[k][0] if k in full else v for k, v in model.named_parameters()}
        torch.func.functional_call(model, p, (x,))
    cols = feat["inp"].reshape(2, 20, s)
    assert (cols[:, 7] == 0).all() and (cols[:, [0, 6, 8]] != 0).any()


# ---------------------------------------------------------------------- 6. end to end


def test_unstructured_pruning_reaches_the_target_and_masks_only_shrink(tmp_path):
    cfg = cfg_of({"method": "unstructured", "target": 0.3, "rate": 0.1, **EAGER}, rounds=6, clients_per_round=8)
    prep = prepare(cfg, tmp_path)
    calls = spy(prep.stages["pruning"], "record")
    masks = []
    st = run_rounds(prep, on_round=lambda s, row: masks.append({k: v.clone() for k, v in s.algo["pruning"]["weights"].dense().items()}))
    trained = [result for _, result in calls]
    assert abs(st.history[-1]["sparsity"] - 0.3) < 1e-3
    sp = [h["sparsity"] for h in st.history]
    assert sp == sorted(sp) and sp[0] == pytest.approx(0.1, abs=2e-3)  # one 10% step per round
    for before, after in zip(masks, masks[1:]):
        for k in before:
            assert not (after[k] & ~before[k]).any()  # never revived
    for res in trained:  # every pruned weight is exactly 0 in each client's own model
        for k, m in res.meta["prune_weights"].items():
            assert (res.params[k][~m] == 0).all()
    # the stored masks are what the clients applied; sparsity is their mean pruned share
    final = st.algo["pruning"]["weights"].dense()
    kept = sum(v.reshape(8, -1).sum(1).double() for v in final.values())
    total = sum(v[0].numel() for v in final.values())
    assert st.history[-1]["sparsity"] == pytest.approx(float((1 - kept / total).mean()))
    assert (st.algo["pruning"]["events"] >= 4).all()
    dense = run_rounds(prepare(cfg_of(rounds=6, clients_per_round=8), tmp_path))
    assert sum(h["bytes_up"] for h in st.history) < sum(h["bytes_up"] for h in dense.history)
    assert st.history[-1]["bytes_up"] < dense.history[-1]["bytes_up"]
    assert all(h["bytes_down"] == d["bytes_down"] for h, d in zip(st.history, dense.history))  # download is dense
    s = summarise(st)["metrics"]
    assert s["sparsity"] == st.history[-1]["sparsity"] and "comm_bytes_thesis" in s


def test_the_personalised_model_is_the_server_model_restricted_to_the_mask(tmp_path):
    """accuracy_pruned evaluates each client with its model ⊙ its mask (BN statistics its own)."""
    from flockfl.eval_protocol import summarise_clients
    from flockfl.evaluation import own_model_metrics
    from flockfl.engine.functional import index_params

    cfg = cfg_of({"method": "unstructured", "target": 0.5, **EAGER}, rounds=3, clients_per_round=8)
    prep = prepare(cfg, tmp_path)
    st = run_rounds(prep)
    ctx = prep.ctx
    w, ch = prep.stages["pruning"].rows(st, ctx.seen)
    full = prep.stages["pruning"].full_masks(w, ch)
    params = index_params(st.models, torch.zeros(len(ctx.seen), dtype=torch.long))
    params = {k: v * full[k] if k in full else v for k, v in params.items()}
    loss, acc, n = own_model_metrics(ctx.model, params, ctx.data.test, ctx.seen, ctx.data.task)
    assert st.history[-1]["accuracy_pruned"] == pytest.approx(summarise_clients(loss, acc, n, "classification")["accuracy"])
    assert st.history[-1]["sparsity"] > 0.2


def test_gates_stop_pruning(tmp_path):
    never = run_rounds(prepare(cfg_of({"method": "unstructured", "acc_threshold": 1.0, "mask_threshold": 0.0}), tmp_path))
    assert all(h["clients_pruned"] == 0 for h in never.history) and never.history[-1]["sparsity"] == 0
    far = run_rounds(prepare(cfg_of({"method": "unstructured", "acc_threshold": 0.0, "mask_threshold": 1.0}), tmp_path))
    assert far.history[-1]["sparsity"] == 0
    before = run_rounds(prepare(cfg_of({"method": "unstructured", "acc_gate": "before_training", **EAGER}), tmp_path))
    assert before.history[-1]["sparsity"] > 0
    # no pruning: the thesis figure is the dense 64 bits per parameter per client and round
    n_params = sum(v[0].numel() for v in never.models.values())
    assert never.history[0]["bytes_thesis"] == 4 * 8 * n_params


def test_thesis_bytes_of_a_dense_mnist_cnn_use_the_thesis_W():
    model = build_model("cnn_bn", (1, 28, 28), 10)
    pr = Pruning(cfg_of({"method": "hybrid"}, model="cnn_bn"), model)
    params = {n: p.detach().clone().unsqueeze(0) for n, p in model.named_parameters()}
    w = {k: torch.ones(1, *pr.shapes[k], dtype=torch.bool) for k in pr.unstructured}
    ch = {g["bn"]: torch.ones(1, pr.shapes[f"{g['bn']}.weight"][0], dtype=torch.bool) for g in pr.groups}
    res = TrainResult(np.array([0]), params, np.array([10]), np.array([1]), np.zeros(1),
                      {"prune_weights": w, "prune_channels": ch, "prune_masks": pr.full_masks(w, ch)})
    _, thesis = pr.upload(res)
    assert thesis == thesis_comm_bytes(21_840, 0.0, 1, 1)  # 300 rounds × 10 clients → 524.16 MB


def test_a_prune_event_that_removes_nothing_is_not_counted(tmp_path):
    cfg = cfg_of({"method": "unstructured", "target": 0.3, "rate": 0.1, **EAGER}, rounds=6, clients_per_round=8)
    masks = []
    st = run_rounds(prepare(cfg, tmp_path), on_round=lambda s, row: masks.append(
        {k: v.clone() for k, v in s.algo["pruning"]["weights"].dense().items()}))
    for r in range(1, 6):
        unchanged = all(torch.equal(masks[r][k], masks[r - 1][k]) for k in masks[r])
        if unchanged:
            assert st.history[r]["clients_pruned"] == 0, (r, st.history[r]["clients_pruned"])


# ---------------------------------------------------------------------- 7. composition


UN_ALGOS = [{"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}, {"name": "scaffold"}, {"name": "ifca", "k": 2},
            {"name": "pacfl", "k": 2}]


def _check_pruned_run(st, channels=False):
    last = st.history[-1]
    for key in ("sparsity", "accuracy_pruned", "bytes_thesis", "comm_bytes_thesis", "clients_pruned"):
        assert key in last, key
    assert last["sparsity"] > 0 and np.isfinite(last["accuracy_pruned"]) and last["bytes_thesis"] > 0
    if channels:
        assert last["channel_sparsity"] > 0 and "channel_mask_distance" in last
    m = summarise(st)["metrics"]
    assert m["sparsity"] == last["sparsity"] and "accuracy_pruned" in m


@pytest.mark.parametrize("algo", UN_ALGOS, ids=[a["name"] for a in UN_ALGOS])
def test_unstructured_pruning_composes_with_algorithms(tmp_path, algo):
    st = run_rounds(prepare(cfg_of({"method": "unstructured", **EAGER}, algo), tmp_path))
    _check_pruned_run(st)
    dense = run_rounds(prepare(cfg_of({}, algo), tmp_path))
    assert dense.digest() != st.digest() and "sparsity" not in dense.history[-1]
    # each cluster's model keeps the entries its members prune at its previous value or their keepers' mean:
    # the models stay finite and every client's own subnetwork has the masked zeros
    assert all(torch.isfinite(v).all() for v in st.models.values())


@pytest.mark.parametrize("method", ["hybrid", "structured"])
@pytest.mark.parametrize("model", ["cnn_bn", "lenet5_bn"])
def test_channel_pruning_runs_on_bn_models(tmp_path, method, model):
    st = run_rounds(prepare(cfg_of({"method": method, "channel_rate": 0.2, **EAGER}, model=model), tmp_path))
    _check_pruned_run(st, channels=True)
    ch = st.algo["pruning"]["channels"].dense()
    assert all((v.sum(1) >= 1).all() for v in ch.values())  # at least one channel per layer stays
    if method == "structured":
        assert st.algo["pruning"]["weights"].names == []


def test_pruning_and_a_curriculum_compose(tmp_path):
    st = run_rounds(prepare(cfg_of({"method": "hybrid", **EAGER}, model="cnn_bn", curriculum={"ordering": "curr"}),
                            tmp_path))
    _check_pruned_run(st, channels=True)
    assert all("difficulty_std" in h for h in st.history)


# ---------------------------------------------------------------------- 8. both trainers


@pytest.mark.parametrize("method,model,layout", [("unstructured", "mlp", "auto"), ("hybrid", "cnn_bn", "auto"),
                                                 ("structured", "lenet5_bn", "contiguous")])
def test_both_trainers_agree_on_pruning_rounds(tmp_path, method, model, layout):
    """Two pruning rounds, both trainers, to 1e-5. structured/lenet5_bn runs NCHW convolutions:
    channels-last (the default) sums the convolutions in another order, and in round 2 one BN
    output whose value is 0 up to rounding (2e-6 against -1e-6) lands on the other side of its
    ReLU, after which the two runs part by 3 % (the masks and the sparsity still agree): a
    float-rounding change a ReLU net amplifies, not a disagreement of the trainers."""
    ref, vec = assert_trainers_agree(lambda e: cfg_of({"method": method, "channel_rate": 0.2, **EAGER}, model=model,
                                                      rounds=2, engine=e, conv_layout=layout), tmp_path)
    for kind in ("weights", "channels"):
        for k, v in ref.algo["pruning"][kind].dense().items():
            assert torch.equal(v, vec.algo["pruning"][kind].dense()[k]), k
    assert ref.history[-1]["sparsity"] == vec.history[-1]["sparsity"] > 0


def test_masked_training_with_a_first_epoch_snapshot_agrees(tmp_path):
    """One pruning round's local work, compared directly: masks, snapshot after the first epoch."""
    from flockfl.rounds import select_stage

    prep = prepare(cfg_of({"method": "hybrid"}, model="cnn_bn", local_epochs=2), tmp_path)
    state, spec = select_stage(prep, prep.algorithm.init_state(prep.ctx), 0)
    sizes = prep.ctx.data.train.sizes[spec.clients]
    np.testing.assert_array_equal(spec.snapshot_steps, np.ceil(sizes / 16))  # the first epoch
    data, task = prep.ctx.data.train, prep.ctx.data.task
    ref = train_reference(prep.ctx.model, spec, data, task, 3, 0)
    vec = train_cohort(prep.ctx.model, spec, data, task, 3, 0)
    for a, b in ((vec.params, ref.params), (vec.meta["snapshot"], ref.meta["snapshot"])):
        assert max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a) < 1e-5


def test_a_snapshot_after_zero_steps_is_the_same_on_both_trainers():
    g = torch.Generator().manual_seed(0)
    from flockfl.engine.data import Split

    x, y = torch.randn(26, 1, 8, 8, generator=g), torch.randint(0, 10, (26,), generator=g)
    split = Split(x, y, np.array([0, 9, 26]))
    model = build_model("mlp", (1, 8, 8), 10, 16)
    init = stack([init_params(model, torch_generator(5, client=i, purpose="init")) for i in range(2)])
    spec = LocalSpec(np.arange(2), init, 0.1, steps=3, batch_size=4, snapshot_steps=np.array([0, 2]))
    ref = train_reference(model, spec, split, "classification", 0, 0)
    vec = train_cohort(model, spec, split, "classification", 0, 0)
    for k in init:
        torch.testing.assert_close(ref.meta["snapshot"][k], vec.meta["snapshot"][k], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- 9. resume


@pytest.mark.parametrize("pr,model", [({"method": "unstructured", "target": 0.4, **EAGER}, "mlp"),
                                      ({"method": "hybrid", "channel_rate": 0.2, **EAGER}, "cnn_bn"),
                                      ({"method": "unstructured", "acc_gate": "before_training", "acc_threshold": 0.05,
                                        "mask_threshold": 0.0}, "mlp")],
                         ids=["unstructured", "hybrid", "before_training"])
def test_resume_mid_pruning_is_bit_identical(tmp_path, pr, model):
    full, resumed = assert_resume_bit_identical(cfg_of(pr, model=model, rounds=4), tmp_path, until=2)
    assert full.history[1]["sparsity"] > 0  # pruning was under way at the checkpoint
    for kind in ("weights", "channels"):
        for k, v in full.algo["pruning"][kind].dense().items():
            assert torch.equal(v, resumed.algo["pruning"][kind].dense()[k])
    np.testing.assert_array_equal(full.algo["pruning"]["events"], resumed.algo["pruning"]["events"])
    strip = lambda h: {k: v for k, v in h.items() if k != "round_time_s"}  # noqa: E731
    assert [strip(h) for h in resumed.history] == [strip(h) for h in full.history]


# ---------------------------------------------------------------------- 10. one-line errors


BAD = [
    ("pruning.target=2", "pruning.target"), ("pruning.target=0", "pruning.target"),
    ("pruning.method=bogus", "pruning.method"), ("pruning.rate=0", "pruning.rate"),
    ("pruning.mask_threshold=-1", "pruning.mask_threshold"), ("pruning.channel_target=1", "pruning.channel_target"),
    ("pruning.channel_rate=1.5", "pruning.channel_rate"), ("pruning.channel_threshold=-0.1", "pruning.channel_threshold"),
    ("pruning.acc_threshold=2", "pruning.acc_threshold"), ("pruning.acc_gate=never", "pruning.acc_gate"),
    ("pruning.method=structured", "pruning.method"), ("pruning.method=hybrid", "pruning.method"),
    ("pruning.bogus=1", "unknown key 'pruning.bogus'"),
    ("curriculum.pacing=log", "curriculum.pacing"), ("curriculum.a=1.5", "curriculum.a"), ("curriculum.b=-0.1", "curriculum.b"),
    ("curriculum.ordering=sideways", "curriculum.ordering"), ("curriculum.scoring=s_X", "curriculum.scoring"),
    ("curriculum.pacing_scope=forever", "curriculum.pacing_scope"),
    ("curriculum.pacing_literal=maybe", "curriculum.pacing_literal"),
    ("curriculum.clients=maybe", "curriculum.clients"), ("curriculum.client_ordering=vanilla", "curriculum.client_ordering"),
    ("curriculum.client_scoring=s_L", "curriculum.client_scoring"), ("curriculum.local_model=latest", "curriculum.local_model"),
    ("curriculum.bogus=1", "unknown key 'curriculum.bogus'"),
    ("partition.difficulty_fraction=2", "partition.difficulty_fraction"),
    ("partition.difficulty_fraction=-0.5", "partition.difficulty_fraction"),
    ("partition.difficulty_model=resnet", "partition.difficulty_model"),
    ("partition.difficulty_epochs=0", "partition.difficulty_epochs"),
    ("model.name=resnet9", "model.name"),
]


@pytest.fixture
def in_workdir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


@pytest.mark.parametrize("setting,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_values_exit_2_with_one_line(in_workdir, capsys, setting, needle):
    from flows.cli import main

    assert main(["run", "fedavg_rotated_digits", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert err.count("\n") == 1 and err.strip() and "Traceback" not in err
    assert not (in_workdir / "runs").exists()  # nothing was started


@pytest.mark.parametrize("settings,needle", [
    (["model.name=linear", "pruning.method=unstructured"], "model.name"),
    (["curriculum.ordering=curr", "train.full_batch=true"], "curriculum.ordering"),
])
def test_keys_that_clash_exit_2_with_one_line(in_workdir, capsys, settings, needle):
    from flows.cli import main

    argv = ["run", "fedavg_rotated_digits"] + [a for s in settings for a in ("--set", s)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_real_process_with_a_bad_pruning_key_prints_one_line(workdir):
    res = run_flock(["run", "fedavg_rotated_digits", "--set", "pruning.method=structured"], workdir, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("flockfl: error: config error: pruning.method")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


# ---------------------------------------------------------------------- sharding


@pytest.mark.parametrize("engine", ["vectorized", "reference"])
def test_shards_of_the_cohort_give_the_same_run(tmp_path, engine):
    """A cohort split into shards (per-client masks, snapshots, curriculum orders and the prune
    metadata follow their clients through ``restrict`` and ``TrainResult.concat``)."""
    def run(shard):
        return run_rounds(prepare(cfg_of({"method": "hybrid", "channel_rate": 0.2, **EAGER}, model="cnn_bn",
                                         curriculum={"ordering": "curr", "scoring": "s_L"}, shard_size=shard,
                                         engine=engine, local_epochs=2), tmp_path))

    whole, parts = run(64), run(3)
    assert max(float((parts.models[k] - whole.models[k]).norm() / whole.models[k].norm().clamp_min(1e-12))
               for k in whole.models) < 1e-5
    for kind in ("weights", "channels"):
        for k, v in whole.algo["pruning"][kind].dense().items():
            assert torch.equal(v, parts.algo["pruning"][kind].dense()[k]), k
    assert whole.history[-1]["sparsity"] == parts.history[-1]["sparsity"] > 0
    assert [h["bytes_up"] for h in whole.history] == [h["bytes_up"] for h in parts.history]


def test_a_method_that_regroups_every_round_is_refused_with_one_line(tmp_path):
    """FLIS-DC's clusters are this round's groups, not the server's models: the masked fill has no
    server value to fall back on (it crashed with an IndexError at the first aggregate). FLIS-HC,
    whose clusters last, still runs with pruning."""
    with pytest.raises(ValueError, match=r"^config error: pruning.method: .*flis_dc forms new clusters.*use pruning.method=none") as e:
        cfg_of(pruning={"method": "unstructured"}, algo={"name": "flis_dc", "server_data_size": 100, "beta": 0.5})
    assert "\n" not in str(e.value)
    cfg = cfg_of(pruning={"method": "unstructured", "acc_threshold": 0.0},
                 algo={"name": "flis_hc", "server_data_size": 100, "beta": 0.5}, rounds=2)
    assert run_rounds(prepare(cfg, tmp_path)).round == 2
