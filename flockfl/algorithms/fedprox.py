"""FedProx — Li et al., "Federated Optimization in Heterogeneous Networks",
https://arxiv.org/abs/1812.06127 (code: litian96/FedProx).

Each local step is the code's perturbed gradient step w ← w − η_l(∇ℓ(w; b) + μ(w − w_t)),
with w_t the round's global model, frozen for the round. The server takes FedAvg's
sample-weighted mean. ``algorithm.mu`` (μ ≥ 0, default 0.01; the paper tunes it over
{0.001, 0.01, 0.1, 0.5, 1}). μ = 0 is FedAvg, bit for bit.
"""

from flockfl.algorithms.base import Algorithm
from flockfl.algorithms.hyper import real


class FedProx(Algorithm):
    name = "fedprox"
    paper = "Li et al., Federated Optimization in Heterogeneous Networks, arXiv 1812.06127"
    hyperparameters = (real("mu", 0.01, "weight of the proximal term (μ/2)‖w − w_t‖²", "μ", ge=0),)

    def local_spec(self, state, ctx, clients, round):
        spec = super().local_spec(state, ctx, clients, round)
        spec.prox_mu = float(self.hp("mu"))  # the anchor defaults to the initial (global) params
        return spec
