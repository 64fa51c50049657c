"""The spec's keys of LG-FedAvg (warm_start_rounds, refresh_global_at_eval), FedBN (local_norm) and
APFL (mix): flockfl/algorithms/lg_fedavg.py, fedbn.py, apfl.py (specs/personalised-baselines.md §3, §9, §11)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flockfl.errors import ConfigError
from test_personal_models import cfg_of, run  # the personal baselines' one config and run helper


def same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------- bad values
@pytest.mark.parametrize("name,key,bad", [
    ("lg_fedavg", "warm_start_rounds", -1), ("lg_fedavg", "warm_start_rounds", 1.5),
    ("lg_fedavg", "warm_start_rounds", "two"), ("lg_fedavg", "refresh_global_at_eval", "yes"),
    ("fedbn", "local_norm", "group"), ("apfl", "mix", "logits"),
])
def test_bad_values_are_one_line_config_errors(name, key, bad):
    with pytest.raises(ConfigError) as err:
        cfg_of(name, algorithm={key: bad})
    msg = str(err.value)
    assert "\n" not in msg and f"algorithm.{key}" in msg and "allowed" in msg


@pytest.mark.parametrize("setting,needle", [
    (["algorithm.name=lg_fedavg", "algorithm.warm_start_rounds=-2"], "algorithm.warm_start_rounds"),
    (["algorithm.name=lg_fedavg", "algorithm.refresh_global_at_eval=maybe"], "algorithm.refresh_global_at_eval"),
    (["algorithm.name=fedbn", "algorithm.local_norm=layer"], "allowed: one of bn, all"),
    (["algorithm.name=apfl", "algorithm.mix=logits"], "allowed: one of params, outputs"),
    (["algorithm.name=fedavg", "algorithm.mix=outputs"], "it is a hyper-parameter of apfl"),
])
def test_cli_bad_values_exit_2_with_one_line(workdir, monkeypatch, capsys, setting, needle):
    from flows.cli import main

    monkeypatch.chdir(workdir)
    argv = ["run", "ifca_rotated_digits"]
    for s in setting:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (workdir / "runs").exists()


# ---------------------------------------------------------------------- LG-FedAvg: warm start
def test_lg_warm_start_rounds_are_fedavg_bit_for_bit(tmp_path):
    """W = 2: after 2 rounds the state is FedAvg's (same weights, no client rows, FedAvg's bytes);
    round 3 is LG, its rows starting from the warm model's local layers."""
    common = {"train": {"rounds": 3, "momentum": 0.5}}
    _, ref = run(cfg_of("fedavg", algorithm={"weighting": "samples"}, **common), tmp_path / "a", until=2)
    prep, warm = run(cfg_of("lg_fedavg", algorithm={"warm_start_rounds": 2, "global_layers": "top:1"}, **common),
                     tmp_path / "b", until=2)
    same(ref.models, warm.models)
    assert "personal" not in warm.algo
    for a, b in zip(ref.history, warm.history):
        assert a["bytes_total"] == b["bytes_total"]
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-6)

    from flockfl.rounds import run_rounds

    lg = run_rounds(prep, warm)  # round 3: LG
    table = lg.algo["personal"]
    cohort = prep.algorithm.select(warm, prep.ctx, 2)
    np.testing.assert_array_equal(np.flatnonzero(table.written()), np.sort(cohort))
    local = prep.algorithm.names(lg)
    assert local and sorted(table.names) == sorted(local + [k for k in lg.models if k not in local])  # stale default
    idle = np.setdiff1d(prep.ctx.seen, cohort)[:1]
    row = table.gather(idle)
    for k in table.names:  # a client not sampled since the warm start holds the warm model
        assert torch.equal(row[k][0], warm.models[k][0]), k
    for k in local:  # the local layers left the server model at the warm model's
        assert torch.equal(lg.models[k], warm.models[k]), k
    h = lg.history[-1]
    per = sum(v[0].numel() * 4 for k, v in lg.models.items() if k not in local)
    assert h["bytes_up"] == len(cohort) * per < warm.history[-1]["bytes_up"]


# ---------------------------------------------------------------------- LG-FedAvg: evaluation with stale θ^g
def test_lg_refresh_changes_only_what_clients_are_measured_with(tmp_path):
    """Training does not depend on refresh_global_at_eval; false measures each client with its own
    model as its last training left it (trained θ_i^g; never sampled: the init), true with the
    current θ^g and its own θ_i^l."""
    common = {"algorithm": {"global_layers": "top:1"}, "train": {"rounds": 2}}
    runs = {}
    for refresh in (False, True):
        c = cfg_of("lg_fedavg", **{**common, "algorithm": {**common["algorithm"], "refresh_global_at_eval": refresh}})
        runs[refresh] = run(c, tmp_path / str(refresh))
    (prep, stale), (_, fresh) = runs[False], runs[True]
    alg, ctx = prep.algorithm, prep.ctx
    same(stale.models, fresh.models)
    local = alg.names(stale)
    ts, tf = stale.algo["personal"], fresh.algo["personal"]
    np.testing.assert_array_equal(ts.written(), tf.written())
    assert sorted(tf.names) == sorted(local) and sorted(ts.names) == sorted(stale.models)
    seen = ctx.seen
    rs, rf = ts.gather(seen), tf.gather(seen)
    for k in local:
        assert torch.equal(rs[k], rf[k]), k

    zeros = np.zeros(len(seen), np.int64)
    ms, mf = alg.own_models(stale, ctx, seen, zeros), alg.own_models(fresh, ctx, seen, zeros)
    init = alg.init_state(ctx).models
    written = ts.written(seen)
    assert written.any() and not written.all()
    glob = [k for k in stale.models if k not in local]
    for k in glob:
        assert torch.equal(mf[k], stale.models[k].expand_as(mf[k])), k  # refreshed: the current θ^g
        assert torch.equal(ms[k], rs[k]), k  # stale: the row
        assert torch.equal(ms[k][~written], init[k].expand(int((~written).sum()), *init[k].shape[1:])), k
        # a trained client's θ_i^g is its own upload, not the server mean
        assert not torch.equal(ms[k][written], stale.models[k].expand(int(written.sum()), *init[k].shape[1:])), k
    for k in local:
        assert torch.equal(ms[k], mf[k]), k
    assert stale.history[-1]["accuracy"] != fresh.history[-1]["accuracy"]


def test_lg_without_global_layers_refuses_under_either_refresh_rule():
    """Nothing global (global_layers=none) is local training, not LG-FedAvg: refused in one line
    whichever evaluation rule is set (issue 35: no silent degeneration)."""
    for r in (False, True):
        with pytest.raises(ConfigError) as err:
            cfg_of("lg_fedavg", algorithm={"global_layers": "none", "refresh_global_at_eval": r})
        assert "algorithm.global_layers=none" in str(err.value) and "\n" not in str(err.value)


def test_lg_stale_newcomers_get_the_current_global_layers(tmp_path):
    prep, st = run(cfg_of("lg_fedavg", algorithm={"global_layers": "top:1"}, partition={"unseen_fraction": 0.25},
                          train={"rounds": 2}), tmp_path)
    unseen = prep.ctx.unseen
    assert len(unseen) and "unseen_accuracy" in st.history[-1]
    mine = prep.algorithm.own_models(st, prep.ctx, unseen, np.zeros(len(unseen), np.int64))
    init = prep.algorithm.init_state(prep.ctx).models
    local = prep.algorithm.names(st)
    for k, v in st.models.items():
        want = (init if k in local else st.models)[k]
        assert torch.equal(mine[k], want.expand_as(mine[k])), k


def test_lg_refresh_true_keeps_the_recorded_behaviour(tmp_path):
    """refresh_global_at_eval=true is the evaluation of before the key: the corpus case ends in the
    digest it had then (the default, false, adds θ_i^g to the client rows)."""
    import digest_corpus as corpus
    from flockfl.config import deep_merge

    raw = deep_merge(corpus.cases()["lg_fedavg/vectorized"], {"algorithm": {"refresh_global_at_eval": True}})
    assert corpus.run_case("lg_fedavg/vectorized", raw, tmp_path) == \
        corpus.recorded()["lg_fedavg/vectorized@refresh_global_at_eval"]


# ---------------------------------------------------------------------- FedBN: local_norm
class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 3)


def test_local_norm_resolves_by_module_type():
    from flockfl.algorithms.fedbn import norm_layers
    from flockfl.algorithms.partial import resolve_layers
    from models import build_model

    m = NormNet()
    assert resolve_layers(m, "bn") == ["bn.weight", "bn.bias"]
    assert norm_layers(m) == ["bn.weight", "bn.bias", "gn.weight", "gn.bias", "inorm.weight", "inorm.bias",
                              "ln.weight", "ln.bias"]
    for name in ("lenet5_bn", "cnn_bn", "mlp"):  # BN-only models: both settings agree
        model = build_model(name, (1, 8, 8), 10, 16)
        assert norm_layers(model) == resolve_layers(model, "bn")


def mlp_ln(input_shape, num_outputs, hidden=200):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), hidden), nn.LayerNorm(hidden), nn.ReLU(),
                         nn.Linear(hidden, num_outputs))


@pytest.mark.parametrize("engine", ["reference", "vectorized"])
def test_local_norm_all_keeps_layernorm_local_and_bn_shares_it(engine, tmp_path, monkeypatch):
    """An MLP with a LayerNorm (registered as 'mlp' for the test): local_norm=bn shares it, which
    leaves nothing personal (there is no BN: FedAvg under FedBN's name, refused in one line);
    local_norm=all keeps it in the client rows, never averaged."""
    import models

    monkeypatch.setitem(models.MODELS, "mlp", mlp_ln)
    common = {"train": {"rounds": 2}}
    _, ref = run(cfg_of("fedavg", engine, algorithm={"weighting": "uniform"}, **common), tmp_path / "a")
    with pytest.raises(ConfigError, match="algorithm.local_norm=bn leaves no trained layer personal"):
        cfg_of("fedbn", engine, **common)
    prep, al = run(cfg_of("fedbn", engine, algorithm={"local_norm": "all"}, **common), tmp_path / "c")
    assert "2.weight" in ref.models  # the LayerNorm
    assert prep.algorithm.names(al) == ["2.weight", "2.bias"]
    init = prep.algorithm.init_state(prep.ctx).models
    table = al.algo["personal"]
    got = table.gather(np.flatnonzero(table.written()))
    for k in ("2.weight", "2.bias"):
        assert torch.equal(al.models[k], init[k]), k  # never averaged
        assert not torch.equal(got[k], init[k].expand_as(got[k])), k  # trained locally
    assert not torch.equal(al.models["1.weight"], init["1.weight"])
    ln = sum(init[k][0].numel() * 4 for k in ("2.weight", "2.bias"))
    clients = al.history[-1]["clients"]
    assert al.history[-1]["bytes_up"] == ref.history[-1]["bytes_up"] - clients * ln


# ---------------------------------------------------------------------- APFL: mix=outputs
def test_apfl_outputs_alpha_zero_is_fedavg(tmp_path):
    """Fixed α = 0 under output mixing: w is FedAvg bit for bit, v never moves (∇_v ℓ(ŷ) = 0·…),
    and the personalised prediction is w's."""
    _, ref = run(cfg_of("fedavg", algorithm={"weighting": "uniform"}), tmp_path / "a")
    prep, ap = run(cfg_of("apfl", algorithm={"alpha": 0.0, "adaptive": False, "mix": "outputs"}), tmp_path / "b")
    same(ref.models, ap.models)
    h, r = ap.history[-1], ref.history[-1]
    assert h["bytes_total"] == r["bytes_total"]
    assert h["accuracy"] == pytest.approx(r["accuracy"], abs=1e-6)
    assert h["accuracy_global"] == pytest.approx(r["accuracy"], abs=1e-6)
    table = ap.algo["personal"]
    assert table.written().any() and torch.all(table.dense()["__alpha__"] == 0)


@pytest.mark.parametrize("over", [{}, {"alpha_l2": 0.02, "alpha_lr": 0.5}])
def test_apfl_outputs_runs_under_either_trainer_and_moves_alpha(over, tmp_path):
    """Output mixing runs whole rounds under both trainers (momentum on): w is FedAvg's (the
    trainers' agreement), α moves and stays in [0, 1]. The (v, α) loop is one loop for both
    trainers, so their agreement on v says nothing: its values are pinned by hand in
    tests/test_personal_rules.py (test_apfl_output_mixing_by_hand)."""
    a, b = (run(cfg_of("apfl", engine=e, algorithm={"mix": "outputs", **over}, train={"rounds": 2, "momentum": 0.5}),
                tmp_path / e)[1] for e in ("reference", "vectorized"))
    for k in a.models:
        torch.testing.assert_close(a.models[k], b.models[k], rtol=1e-5, atol=1e-6)
    alpha = a.algo["personal"].dense()["__alpha__"]
    assert float(alpha.min()) >= 0 and float(alpha.max()) <= 1 and not torch.all(alpha == 0.5)  # α moved


def test_apfl_outputs_differs_from_params(tmp_path):
    a = run(cfg_of("apfl", train={"rounds": 2}), tmp_path / "p")[1]
    b = run(cfg_of("apfl", algorithm={"mix": "outputs"}, train={"rounds": 2}), tmp_path / "o")[1]
    same(a.models, b.models)  # w is FedAvg either way
    va, vb = a.algo["personal"].dense(), b.algo["personal"].dense()
    assert not torch.equal(va["__alpha__"], vb["__alpha__"])


def test_apfl_output_mix_gradients_by_finite_differences():
    """output_mix_step: ∇_v and ∂/∂α of ℓ(α f(x; v) + (1 − α) f(x; w)) with f(x; w) held fixed."""
    from torch.func import functional_call

    from flockfl.algorithms.apfl import output_mix_step
    from flockfl.engine.functional import per_sample_loss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).double()
    names = [n for n, _ in model.named_parameters()]
    v = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    w = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 3, (7,))
    a = 0.3

    def loss(vv, aa):
        out = aa * functional_call(model, vv, (x,)) + (1 - aa) * functional_call(model, w, (x,))
        return float(per_sample_loss(out, y, "classification").mean())

    g_v, d_alpha = output_mix_step(model, names, "classification")(v, w, a, x, y)
    eps = 1e-6
    assert d_alpha == pytest.approx((loss(v, a + eps) - loss(v, a - eps)) / (2 * eps), rel=1e-6)
    k, i = "2.weight", (1, 2)
    up, down = {**v, k: v[k].clone()}, {**v, k: v[k].clone()}
    up[k][i] += eps
    down[k][i] -= eps
    assert float(g_v[k][i]) == pytest.approx((loss(up, a) - loss(down, a)) / (2 * eps), rel=1e-6)
    assert all(not g.requires_grad for g in g_v.values())
    # w is held fixed: no gradient reaches it
    assert all(not t.requires_grad for t in w.values())
