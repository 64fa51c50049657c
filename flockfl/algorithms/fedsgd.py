"""FedSGD — the baseline of McMahan et al., https://arxiv.org/abs/1602.05629.

Every selected client computes its full-batch gradient g_i at the global model; the server
applies w ← w − η Σ_i (n_i/N_t) g_i with η = ``train.lr``. Numerically this equals FedAvg
with one full-batch local step (E = 1, B = ∞), which is how it runs here: the client's
one step gives Δ_i = w − w_i = η g_i and the server subtracts the weighted mean of Δ_i.
"""

from flockfl.algorithms.base import Algorithm
from flockfl.engine.schedule import LocalSpec


class FedSGD(Algorithm):
    name = "fedsgd"
    paper = "McMahan et al. (FedSGD baseline), arXiv 1602.05629"

    def local_spec(self, state, ctx, clients, round) -> LocalSpec:
        spec = super().local_spec(state, ctx, clients, round)
        spec.full_batch, spec.steps, spec.epochs, spec.client_epochs = True, 1, 1, None
        return spec

    def aggregate(self, state, ctx, spec, result, assign):
        delta = self.pseudo_gradient(state, result)  # Σ p_i η g_i
        models = {k: (v[0] - delta[k]).unsqueeze(0) for k, v in state.models.items()}
        return self._with_assignments(state, models, result.clients, assign)
