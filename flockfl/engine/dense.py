"""A hand-written cohort step for dense stacks (Flatten → Linear/ReLU … → Linear).

``vmap(grad)`` materialises a fresh per-client gradient for every weight at every step and
then a fresh updated copy: for W1 (120 clients of MLP 784-200-10) that is two new 75 MB
tensors per step, and the trainer becomes memory-bound, no faster than a Python loop.
For Linear/ReLU stacks the backward pass is short enough to write out: the weight update
W ← W − η·δᵀx is applied in place with one ``baddbmm_`` per layer, so each step reads and
writes every weight once and allocates nothing large. MCLR, the MLP and linear regression
take this path; anything else (LeNet-5, …) uses the generic torch.func path. Tests check
both against the per-client reference loop.
"""

from __future__ import annotations

import torch
from torch import nn


def dense_layers(model: nn.Module) -> list[str] | None:
    """Parameter-name prefixes of the Linear layers if ``model`` is a dense stack, else None."""
    if not isinstance(model, nn.Sequential):
        return None
    names, mods = [], list(model.named_children())
    for i, (name, m) in enumerate(mods):
        if isinstance(m, nn.Linear):
            names.append(name)
        elif isinstance(m, nn.Flatten) and i == 0:
            continue
        elif not isinstance(m, nn.ReLU):
            return None
    if not names or not isinstance(mods[-1][1], nn.Linear):
        return None
    relu_after = [isinstance(mods[i + 1][1], nn.ReLU) for i, (_, m) in enumerate(mods[:-1]) if isinstance(m, nn.Linear)]
    return names if all(relu_after) else None  # every hidden Linear is followed by a ReLU


@torch.no_grad()
def dense_step(params: dict[str, torch.Tensor], layers: list[str], x: torch.Tensor, y: torch.Tensor,
               w: torch.Tensor, lr: float, task: str) -> torch.Tensor:
    """One SGD step for every client, in place. x: [C, B, ...], y: [C, B], w: [C, B]
    per-sample weights (1/batch, 0 for padding). Returns the weighted loss per client."""
    acts = [x.reshape(x.shape[0], x.shape[1], -1)]
    for i, name in enumerate(layers):
        wt, b = params[f"{name}.weight"], params.get(f"{name}.bias")
        z = torch.bmm(acts[-1], wt.transpose(1, 2))
        if b is not None:
            z += b.unsqueeze(1)
        acts.append(z.clamp_min_(0) if i < len(layers) - 1 else z)
    out = acts.pop()
    if task == "regression":
        diff = out.squeeze(-1) - y
        loss = (diff * diff * w).sum(1)
        delta = (2 * diff * w).unsqueeze(-1)
    else:
        logp = torch.log_softmax(out, -1)
        nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        loss = (nll * w).sum(1)
        delta = logp.exp_()
        delta.scatter_add_(-1, y.unsqueeze(-1), -torch.ones_like(y, dtype=delta.dtype).unsqueeze(-1))
        delta *= w.unsqueeze(-1)
    # backward through the stack: compute every layer's δ before touching its weight
    for i in range(len(layers) - 1, -1, -1):
        name, a = layers[i], acts[i]
        wt, b = params[f"{name}.weight"], params.get(f"{name}.bias")
        nxt = None
        if i > 0:
            nxt = torch.bmm(delta, wt)
            nxt *= a > 0  # ReLU'(z) from the stored activation
        wt.baddbmm_(delta.transpose(1, 2), a, alpha=-lr)
        if b is not None:
            b.sub_(delta.sum(1), alpha=lr)
        delta = nxt
    return loss


@torch.no_grad()
def dense_forward(models: dict[str, torch.Tensor], layers: list[str], x: torch.Tensor) -> torch.Tensor:
    """Outputs of k stacked dense models on shared inputs x [N, ...]: returns [k, N, out]."""
    a = x.reshape(1, x.shape[0], -1)
    for i, name in enumerate(layers):
        wt, b = models[f"{name}.weight"], models.get(f"{name}.bias")
        a = torch.matmul(a, wt.transpose(1, 2))
        if b is not None:
            a += b.unsqueeze(1)
        if i < len(layers) - 1:
            a.clamp_min_(0)
    return a
