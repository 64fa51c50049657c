"""CC-FL — Sun, Wu, Huang, Zhang, "Client-Centric Federated Adaptive Optimization",
https://arxiv.org/abs/2501.09946 (seed 000, Algorithms 1–3; spec §3.4).

Clients decide for themselves: in round t each client takes part with probability
``algorithm.availability`` (its own (seed, round, client, "availability") draw). A client
that takes part trains on the global model it last downloaded, x_{t−d}, with a bounded random
delay d ∈ {0..``max_delay``}; it runs K_{t,i} local steps (K_{t,i} ~ U{1..K}, K =
``train.local_steps``, redrawn per client and round) and returns the normalised update

    Δ^i = (x_{t−d} − x^i_K) / K_{t,i}.

The server, with m = ``algorithm.participants`` (a fixed divisor, not |S_t|; default
availability·N):

    Δ_t = (1/m) Σ_{i∈S_t} Δ^i
    avg:      x ← x − η Δ_t                                   (CC-FedAvg)
    m1 = β m1 + (1 − β) Δ_t;  x ← x − η m1 / (√v̂ + ε) with
    adagrad:  v̂ ← v̂ + Δ_t²
    adam:     v̂ ← γ v̂ + (1 − γ) Δ_t²
    ams:      v ← γ v + (1 − γ) Δ_t²,  v̂ ← max(v̂, v)

β = ``beta1`` (0.9), γ = ``beta2`` (0.99), ε = ``tau`` (1e-3), η = ``server_lr`` (1.0 for
avg, 0.01 for the adaptive rules). Second moments start at ε². This is a round-synchronous
rendering of the asynchronous protocol: an update computed on x_{t−d} is applied at t, i.e. it
arrives with staleness d. The last max_delay+1 global models, m1 and v̂ (and v) live in the
state, so a resume is exact.
"""

from __future__ import annotations

import numpy as np
import torch

from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import Hyper, choice, integer, real, weighting
from flockfl.rng import np_rng


# the server optimiser's defaults (spec §3.4): FedOpt's, as the paper's tuned values are not in the seed
FEDOPT = {"source": "library", "note": "mirrors FedOpt; the paper's tuned values are not in the seed"}


class CCFL(Algorithm):
    name = "ccfl"
    paper = "Sun, Wu, Huang, Zhang, Client-Centric Federated Adaptive Optimization, arXiv 2501.09946"
    hyperparameters = (
        weighting("uniform", source="paper", note="Alg. 2: Δ_t = (1/m) Σ_{i∈S_t} Δ^i"),
        choice("server_opt", "avg", ("avg", "adam", "adagrad", "ams"), "server rule", source="paper",
               note="CC-FedAvg; adam, adagrad and ams are the paper's adaptive variants (Alg. 2)"),
        real("availability", 0.5, "probability that a client takes part in a round", "p", gt=0, le=1, source="library",
             note="the paper leaves availability to the clients; a Bernoulli model of ours"),
        integer("max_delay", 2, "staleness bound: a client trains on x_{t−d}, d ≤ max_delay", "d_max", ge=0,
                source="library", note="the simulation's staleness model"),
        integer("participants", None, "the divisor m of Δ_t (null: availability·N)", "m", ge=1, optional=True,
                source="library", note="the paper's m is a fixed hyper-parameter without a value"),
        Hyper("server_lr", None, "server learning rate (null: 1.0 for avg, 0.01 for the adaptive rules)", "η",
              ge=None, gt=0, optional=True, **FEDOPT),
        real("beta1", 0.9, "first-moment decay", "β", ge=0, lt=1, **FEDOPT),
        real("beta2", 0.99, "second-moment decay", "γ", gt=0, lt=1, **FEDOPT),
        real("tau", 1e-3, "adaptivity ε; second moments start at ε²", "ε", gt=0, **FEDOPT),
    )

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if cfg.train.local_steps is None:
            raise ValueError("train.local_steps: CC-FL draws K_{t,i} from 1..local_steps; set train.local_steps")

    def hp(self, key):
        if key == "server_lr" and self.cfg.algorithm.server_lr is None:
            return 1.0 if self.cfg.algorithm.server_opt == "avg" else 0.01
        return super().hp(key)

    def participants(self, ctx) -> float:
        a = self.cfg.algorithm
        return float(a.participants or max(1.0, a.availability * len(ctx.seen)))

    def init_state(self, ctx):
        state = super().init_state(ctx)
        past = {k: v[:1].expand(self.cfg.algorithm.max_delay + 1, *v.shape[1:]).clone() for k, v in state.models.items()}
        return state.replace(algo={"past_models": past})  # past_models[d] = x_{t−d}

    def select(self, state, ctx, round):
        p = self.cfg.algorithm.availability
        return np.array([c for c in ctx.seen if np_rng(ctx.seed, round, c, "availability").random() < p],
                        dtype=np.int64)

    def delays(self, ctx, clients, round) -> np.ndarray:
        bound = min(self.cfg.algorithm.max_delay, round)  # nothing older than the start exists
        return np.array([np_rng(ctx.seed, round, int(c), "delay").integers(0, bound + 1) for c in clients], dtype=np.int64)

    def local_spec(self, state, ctx, clients, round):
        spec = super().local_spec(state, ctx, clients, round)
        d = torch.from_numpy(self.delays(ctx, clients, round))
        spec.init = {k: v[d] for k, v in state.algo["past_models"].items()}  # x_{t−d_i}
        spec.client_steps = np.array([np_rng(ctx.seed, round, int(c), "local_steps").integers(1, self.cfg.train.local_steps + 1)
                                      for c in clients], dtype=np.int64)
        spec.client_epochs = None
        return spec

    def aggregate(self, state, ctx, spec, result, assign):
        a = self.cfg.algorithm
        eta, beta, gamma, eps = float(self.hp("server_lr")), float(self.hp("beta1")), float(self.hp("beta2")), float(self.hp("tau"))
        k_steps = torch.from_numpy(np.maximum(result.num_steps, 1).astype(np.float32)).to(next(iter(result.params.values())).device)
        algo = dict(state.algo)
        models = {}
        for k, v in state.models.items():
            x = v[0]
            shape = (-1,) + (1,) * x.dim()
            delta = ((spec.init[k] - result.params[k]) / k_steps.reshape(shape)).sum(0) / self.participants(ctx)
            if a.server_opt == "avg":
                models[k] = (x - eta * delta).unsqueeze(0)
                continue
            m1 = beta * algo.get("m1", {}).get(k, torch.zeros_like(x)) + (1 - beta) * delta
            v_hat = algo.get("v_hat", {}).get(k, torch.full_like(x, eps * eps))
            d2 = delta * delta
            if a.server_opt == "adagrad":
                v_hat = v_hat + d2
            elif a.server_opt == "adam":
                v_hat = gamma * v_hat + (1 - gamma) * d2
            else:  # ams
                v_raw = gamma * algo.get("v", {}).get(k, torch.full_like(x, eps * eps)) + (1 - gamma) * d2
                algo.setdefault("v_new", {})[k] = v_raw
                v_hat = torch.maximum(v_hat, v_raw)
            algo.setdefault("m1_new", {})[k], algo.setdefault("v_hat_new", {})[k] = m1, v_hat
            models[k] = (x - eta * m1 / (v_hat.sqrt() + eps)).unsqueeze(0)
        for name in ("m1", "v_hat", "v"):
            if f"{name}_new" in algo:
                algo[name] = algo.pop(f"{name}_new")
        # the model history shifts: x_{t+1} becomes past_models[0]
        algo["past_models"] = {k: torch.cat([models[k], p[:-1]]) for k, p in state.algo["past_models"].items()}
        new = self._with_assignments(state, models, result.clients, assign)
        return new.replace(algo=algo)
