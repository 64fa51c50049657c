"""Sub-FedAvg: personalised subnetworks by pruning (thesis Chapter 4; spec §2), for any algorithm.

Config section ``pruning``; ``method``:

- ``unstructured`` (Algorithm 10): magnitude pruning of every conv and linear weight.
- ``structured``: channel pruning by the BatchNorm scaling factors |γ| (Network Slimming).
- ``hybrid`` (Algorithm 11): channels on the conv layers, magnitude pruning on the linear
  layers; the two decisions are independent.

One round for a selected client k (both trainers, the same code):

1. It starts from its model ⊙ its mask (the server's model of its cluster, restricted to
   its subnetwork), and trains with every update multiplied by the mask, so a pruned weight
   stays 0 and **a mask never revives a weight**.
2. Candidate masks come from the parameters after the first epoch (``m_fe``; after the first
   fifth of the steps when one epoch is the whole budget) and after the last (``m_le``): per layer, the ``rate`` share of the still-alive weights with the
   smallest |w| (channels: of the layer's alive channels with the smallest |γ|, at least
   one kept). The last event is shrunk so the target is met exactly (the authors' code).
3. With Δ the mean over layers of the normalised Hamming distance between ``m_fe`` and
   ``m_le``, the client applies ``m_le`` when its accuracy is at least ``acc_threshold``,
   its pruned share is below the target, and Δ ≥ the threshold. The accuracy gate is taken
   on the masked model after training (``acc_gate=after_mask``, the code) or on the
   received model (``before_training``, the seed's Algorithm 10), on the client's test data
   (the code's ``split_test=False``). Hybrid (Algorithm 11) decides the weight mask and the
   channel mask independently, each with its own distance (Δ_us ≥ ``mask_threshold``,
   Δ_s ≥ ``channel_threshold``), target (``target``, ``channel_target``) and, after
   masking, its own accuracy gate: as in the authors' ``client_s.py``, the weight mask is
   tried on the model with the channels it had, then the channel mask on top of the
   weights kept; one mask failing never holds the other back.
4. It sends the masked parameters and its mask.

The server then averages each entry over the clients of its cluster that keep it, with the
algorithm's client weights; an entry no client kept stays as it was (§2.5, the code's
per-coordinate masked mean). This is done before the algorithm's own aggregation by filling
each client's pruned entries with its cluster's keeper mean: any aggregation that is a
weighted mean within clusters (FedAvg, FedProx, SCAFFOLD, IFCA, PACFL, …) then gives the
masked mean exactly, without touching the algorithm.

BatchNorm (the ``lenet5_bn`` and ``cnn_bn`` models): γ and β are parameters, averaged over the
clients that keep their channel. The statistics are personal: a client recomputes them over
its own training data after every local training and whenever it evaluates its subnetwork; the
server averages the ones it receives, over the keepers, for the models it reports itself.

State (``state.algo['pruning']``): every client's weight masks and channel masks (bool, in
two :class:`~flockfl.clientstate.ClientTable`, so memory and checkpoints grow with the clients a
round touches, not the population), and how many prune events it applied. Communication: a pruned entry is not sent; the upload
carries the kept entries and a one-bit-per-entry mask (``bytes_up``), the download is dense.
The thesis's own figure, 32·|W| + 32·(1−p)|W| + 1·p|W| bits per client and round (§2.8), is
logged beside it as ``bytes_thesis``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from flockfl.client import finetune_epochs, pass_spec, train_pass
from flockfl.clientstate import ClientTable, chunks
from flockfl.engine.evaluate import strided_pooling
from flockfl.engine.functional import index_params
from flockfl.engine.schedule import LocalSpec
from flockfl.eval_protocol import ClientMetrics, family, protocol
from flockfl.evaluation import measure_own, own_model_metrics
# precise BN one client at a time: the cache below recalibrates only the clients whose subnetwork changed, and a
# client's statistics must be the same bits whichever clients share its pass (the batched pass's are not)
from flockfl.engine.bn import calibrate_bn_loop as calibrate_bn
from flockfl.engine.trainers import stat_names
from flockfl.stages.masks import (apply_masks, changed_rows, first_mask_steps, flag_rows, hamming, magnitude_masks,
                                  subnet_key, thesis_comm_bytes)


class SubFedAvg:
    """Sub-FedAvg's method over one run's model: the masks, the client's prune decision, the
    server's masked mean, the per-client subnetwork evaluation (the stage :class:`~flockfl.stages.pruning.Pruning`
    calls it from the round's hooks)."""

    def __init__(self, cfg, model: torch.nn.Module):
        self.cfg = cfg
        self.p = cfg.pruning
        self.method = self.p.method
        frozen = stat_names(model)
        named = dict(model.named_parameters())
        self.trainable = [n for n in named if n not in frozen]
        self.weights = [n for n in self.trainable if named[n].dim() >= 2]
        linear = [n for n in self.weights if named[n].dim() == 2]
        self.unstructured = {"unstructured": self.weights, "hybrid": linear}.get(self.method, [])
        self.groups = model.channel_groups() if self.method in ("structured", "hybrid") else []
        self.shapes = {n: tuple(p.shape) for n, p in named.items()}
        self.eval_chunk = cfg.train.eval_chunk
        self.eps_us = self.p.mask_threshold if self.p.mask_threshold is not None else (
            0.05 if self.method == "hybrid" else 1e-4)
        # client → (digest of its evaluated subnetwork and data, its BN statistics): see ``calibrated``
        self._bn: dict[int, tuple[str, dict[str, torch.Tensor]]] = {}

    @property
    def on(self) -> bool:
        return self.method != "none"

    def _owned(self, g: dict) -> list[str]:
        bn, prod = g["bn"], g["producer"]
        return [f"{prod}.weight", f"{prod}.bias", f"{bn}.weight", f"{bn}.bias", f"{bn}.running_mean",
                f"{bn}.running_var", f"{g['consumer']}.weight"]

    # ------------------------------------------------------------------ state
    def store(self, state) -> dict:
        if "pruning" not in state.algo:
            n = len(state.assignments)
            state.algo = {**state.algo, "pruning": {
                "weights": ClientTable(n, {k: torch.ones(self.shapes[k], dtype=torch.bool) for k in self.unstructured}),
                "channels": ClientTable(n, {g["bn"]: torch.ones(self.shapes[f"{g['bn']}.weight"][0], dtype=torch.bool)
                                            for g in self.groups}),
                "events": np.zeros(n, np.int64)}}
        return state.algo["pruning"]

    def rows(self, state, clients: np.ndarray, device=None) -> tuple[dict, dict]:
        st = self.store(state)
        return st["weights"].gather(clients, device), st["channels"].gather(clients, device)

    def full_masks(self, weights: dict, channels: dict) -> dict[str, torch.Tensor]:
        """Float 0/1 masks of every masked parameter from the weight and channel masks."""
        out = {k: v.float() for k, v in weights.items()}
        c = next(iter({**weights, **channels}.values())).shape[0] if (weights or channels) else 0
        for g in self.groups:
            cm = channels[g["bn"]].float()  # [C, o]
            for name in self._owned(g)[:-1]:
                shape = self.shapes[name]
                m = cm.reshape(c, shape[0], *([1] * (len(shape) - 1))).expand(c, *shape)
                out[name] = out[name] * m if name in out else m.clone()
            cons = f"{g['consumer']}.weight"
            shape = self.shapes[cons]
            if g["spatial"] is None:  # the next conv's input channels
                m = cm.reshape(c, 1, shape[1], *([1] * (len(shape) - 2))).expand(c, *shape)
            else:  # the first linear layer's inputs: `spatial` columns per channel (channel-major flatten)
                m = cm.repeat_interleave(g["spatial"], dim=1).reshape(c, 1, shape[1]).expand(c, *shape)
            out[cons] = out[cons] * m if cons in out else m.clone()
        return out

    # ------------------------------------------------------------------ the round
    def prepare_spec(self, state, spec: LocalSpec, sizes: np.ndarray) -> LocalSpec:
        """Each selected client starts from its model ⊙ its mask, trains masked, and records
        its parameters after its first epoch."""
        if not len(spec.clients):
            return spec
        w, ch = self.rows(state, spec.clients, next(iter(spec.init.values())).device)
        masks = self.full_masks(w, ch)
        return dataclasses.replace(spec, init=apply_masks(spec.init, masks), masks=masks,
                                   snapshot_steps=first_mask_steps(spec, sizes),
                                   meta={**(spec.meta or {}), "pruning_weights": w, "pruning_channels": ch})

    def client_update(self, ctx, spec: LocalSpec, result):
        """Steps 2–4 above for every client of a trained shard; returns the result with the
        masked parameters and each client's new masks in ``meta``."""
        params = {k: v.clone() for k, v in result.params.items()}
        snap = result.meta["snapshot"]
        clients = result.clients
        w_old, ch_old = self.rows_from_spec(spec)
        w_fe, ch_fe, w_le, ch_le = {}, {}, {}, {}
        frac_w = self._pruned_share(w_old, len(clients))
        frac_c = self._pruned_share(ch_old, len(clients))
        q_w = np.where(frac_w < self.p.target, np.minimum(self.p.rate, (self.p.target - frac_w) / np.maximum(1 - frac_w, 1e-12)), 0.0)
        q_c = np.where(frac_c < self.p.channel_target,
                       np.minimum(self.p.channel_rate, (self.p.channel_target - frac_c) / np.maximum(1 - frac_c, 1e-12)), 0.0)
        for k in self.unstructured:
            w_fe[k] = magnitude_masks(snap[k], w_old[k], q_w)
            w_le[k] = magnitude_masks(params[k], w_old[k], q_w)
        for g in self.groups:
            bn = g["bn"]
            ch_fe[bn] = magnitude_masks(snap[f"{bn}.weight"], ch_old[bn], q_c, keep_one=True)
            ch_le[bn] = magnitude_masks(params[f"{bn}.weight"], ch_old[bn], q_c, keep_one=True)
        n = len(clients)
        d_us = np.array([np.mean([hamming(w_fe[k][i], w_le[k][i]) for k in self.unstructured]) if self.unstructured else 0.0
                         for i in range(n)])
        d_s = np.array([np.mean([hamming(ch_fe[b][i], ch_le[b][i]) for b in ch_le]) if ch_le else 0.0 for i in range(n)])
        # each mask has its own distance threshold and target (and, below, its own accuracy gate)
        want_w = (frac_w < self.p.target) & (d_us >= self.eps_us) & bool(self.unstructured)
        want_c = (frac_c < self.p.channel_target) & (d_s >= self.p.channel_threshold) & bool(self.groups)
        # an event counts only if it removes something (per-layer floors can leave a shortfall
        # of under one weight per layer that no further event closes)
        changed_w = changed_rows(w_le, w_old, n)
        changed_c = changed_rows(ch_le, ch_old, n)
        gate = {}
        if self.p.acc_gate == "before_training":  # the received model: the spec's (masked) start; one
            _, acc, _ = self.subnet_metrics(ctx, spec.init, clients)  # measurement, then each mask on its own
            ok_w = ok_c = acc >= self.p.acc_threshold
            gate["prune_gate_accuracy"] = acc
        else:  # the authors' code: the weight mask is tried on the model with its channels as they were,
            # then the channel mask on top of the weights kept; each is kept if its accuracy passes
            ok_w = ok_c = np.zeros(n, bool)
            if self.unstructured:
                cand_w = {k: torch.where(flag_rows(want_w, w_le[k]), w_le[k], w_old[k]) for k in w_old}
                _, acc_w, _ = self.subnet_metrics(ctx, apply_masks(params, self.full_masks(cand_w, ch_old)), clients)
                ok_w = acc_w >= self.p.acc_threshold
                gate["prune_gate_accuracy"] = acc_w
        apply_w = want_w & ok_w & changed_w
        new_w = {k: torch.where(flag_rows(apply_w, w_le[k]), w_le[k], w_old[k]) for k in w_old}
        if self.p.acc_gate != "before_training" and self.groups:
            cand_c = {k: torch.where(flag_rows(want_c, ch_le[k]), ch_le[k], ch_old[k]) for k in ch_old}
            _, acc_c, _ = self.subnet_metrics(ctx, apply_masks(params, self.full_masks(new_w, cand_c)), clients)
            ok_c = acc_c >= self.p.acc_threshold
            gate["channel_prune_gate_accuracy" if self.unstructured else "prune_gate_accuracy"] = acc_c
        apply_c = want_c & ok_c & changed_c
        new_c = {k: torch.where(flag_rows(apply_c, ch_le[k]), ch_le[k], ch_old[k]) for k in ch_old}
        masks = self.full_masks(new_w, new_c)
        params = apply_masks(params, masks)
        calibrate_bn(ctx.model, params, ctx.data.train, clients)
        meta = {**{k: v for k, v in result.meta.items() if k != "snapshot"},
                "prune_weights": new_w, "prune_channels": new_c, "prune_masks": masks, "pruned_now": (apply_w | apply_c),
                "mask_distance": d_us, "channel_mask_distance": d_s, **gate}
        return dataclasses.replace(result, params=params, meta=meta)

    def rows_from_spec(self, spec: LocalSpec) -> tuple[dict, dict]:
        """The clients' current weight and channel masks (put in the spec by prepare_spec)."""
        return dict(spec.meta["pruning_weights"]), dict(spec.meta["pruning_channels"])

    @staticmethod
    def subnet_metrics(ctx, params: dict, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Test loss, accuracy and sizes of each client's subnetwork (row i for ``clients[i]``),
        with BN statistics recomputed on the client's own training data (on a copy)."""

        params = {k: v.clone() for k, v in params.items()}
        calibrate_bn(ctx.model, params, ctx.data.train, clients)
        return own_model_metrics(ctx.model, params, ctx.data.test, clients, ctx.data.task)

    @staticmethod
    def _pruned_share(masks: dict, n: int) -> np.ndarray:
        if not masks:
            return np.zeros(n)
        kept = sum(v.reshape(v.shape[0], -1).sum(1).double() for v in masks.values())
        total = sum(v[0].numel() for v in masks.values())
        return (1 - kept / total).cpu().numpy()

    # ------------------------------------------------------------------ server side
    def fill(self, alg, state, result, assign: np.ndarray):
        """Each client's pruned entries set to its cluster's keeper mean (the server's value
        where no member keeps the entry), so the algorithm's weighted mean is the masked mean."""
        masks = result.meta["prune_masks"]
        params = {k: v.clone() for k, v in result.params.items()}
        for j in np.unique(assign):
            if j < 0:
                continue
            members = np.flatnonzero(assign == j)
            w = alg.weights(result, members).to(torch.float64)
            pos = torch.from_numpy(members)
            for k, m in masks.items():
                mk = m[pos].double()
                theta = result.params[k][pos].double()
                shape = (-1,) + (1,) * (theta.dim() - 1)
                den = (w.reshape(shape) * mk).sum(0)
                num = (w.reshape(shape) * mk * theta).sum(0)
                server = state.models[k][int(j)].double()
                mean = torch.where(den > 0, num / den.clamp_min(1e-300), server)
                params[k][pos] = (mk * theta + (1 - mk) * mean).to(params[k].dtype)
        return dataclasses.replace(result, params=params)

    def record(self, state, result) -> tuple[dict, dict]:
        """Store the trained clients' new masks; returns the round's counts and means to log."""
        st = self.store(state)
        weights = st["weights"].scatter(result.clients, result.meta["prune_weights"])
        channels = st["channels"].scatter(result.clients, result.meta["prune_channels"])
        events = st["events"].copy()
        events[result.clients] += result.meta["pruned_now"].astype(np.int64)
        state.algo = {**state.algo, "pruning": {"weights": weights, "channels": channels, "events": events}}
        means = {}
        if self.unstructured:
            means["mask_distance"] = float(np.mean(result.meta["mask_distance"]))
        if self.groups:
            means["channel_mask_distance"] = float(np.mean(result.meta["channel_mask_distance"]))
        return {"clients_pruned": int(result.meta["pruned_now"].sum())}, means

    # ------------------------------------------------------------------ accounting
    def sparsity(self, state, clients: np.ndarray) -> dict[str, float]:
        """Mean over ``clients`` of the share of conv/linear weights their masks prune (and
        of BN channels, for structured and hybrid), in chunks of ``train.eval_chunk`` clients."""
        total = sum(math.prod(self.shapes[k]) for k in self.weights)
        pruned, channel = [], []
        for part in chunks(clients, self.eval_chunk):
            w, ch = self.rows(state, part)
            full = self.full_masks(w, ch)
            kept = sum((full[k].reshape(len(part), -1).sum(1).double() if k in full
                        else torch.full((len(part),), float(math.prod(self.shapes[k])), dtype=torch.float64))
                       for k in self.weights)
            pruned.append((1 - kept / total).numpy())
            channel.append(self._pruned_share(ch, len(part)))
        out = {"sparsity": float(np.concatenate(pruned).mean()) if pruned else 0.0}
        if self.groups:
            out["channel_sparsity"] = float(np.concatenate(channel).mean()) if channel else 0.0
        return out

    def thesis_params(self) -> list[str]:
        """|W| of the thesis's formula: the conv and linear weights and biases (BN left out,
        as its 21,840 for the MNIST CNN)."""
        bn = {g["bn"] for g in self.groups} | {n.rsplit(".", 1)[0] for n in self.shapes if n.endswith("running_mean")}
        return [n for n in self.trainable if n.rsplit(".", 1)[0] not in bn]

    def upload(self, result) -> tuple[int, float]:
        """(bytes saved on the upload against a dense model, the thesis's bytes) of a round's
        trained clients: a pruned entry is not sent, the mask costs one bit per masked entry."""
        masks = result.meta["prune_masks"]
        elem = next(iter(result.params.values())).element_size()
        masked_entries = sum(math.prod(self.shapes[k]) for k in masks)
        layers = self.thesis_params()
        size = sum(math.prod(self.shapes[k]) for k in layers)
        saved, thesis = 0, 0.0
        for i in range(len(result.clients)):
            pruned = sum(int((m[i] == 0).sum()) for m in masks.values())
            pruned_w = sum(int((masks[k][i] == 0).sum()) for k in masks if k in layers)
            saved += elem * pruned - math.ceil(masked_entries / 8)
            thesis += thesis_comm_bytes(size, pruned_w / size, 1, 1)
        return saved, thesis

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, prep, state, metrics: dict, round: int, finetune: bool) -> dict:
        """Each federating client with its own subnetwork (its model ⊙ its mask, with its own
        BN statistics): ``accuracy_pruned``; after ``train.finetune_epochs`` of masked local
        training: ``accuracy_pruned_finetuned``; and the sparsity reached."""

        ctx, t = prep.ctx, prep.cfg.train
        device = ctx.data.train.x.device
        assign_all = np.maximum(np.asarray(metrics["_assignment"]), 0)
        plain, tuned = [], []
        for seen in chunks(ctx.seen, self.eval_chunk):  # memory: one chunk of clients' masks and models
            masks = self.full_masks(*self.rows(state, seen, device))
            params = apply_masks(index_params(state.models, torch.from_numpy(assign_all[seen]).to(device)), masks)
            plain.append(measure_own(ctx, self.calibrated(ctx, params, seen), seen))
            if finetune:
                spec = pass_spec(t, seen, params, finetune_epochs(t), stream="finetune", masks=masks, momentum=t.momentum)
                res = train_pass(ctx, spec, round)
                tuned.append(measure_own(ctx, res.params, seen))
        proto = protocol(ctx)
        out = family(ClientMetrics.join(plain), proto, ctx.data.task, "_pruned")
        if finetune:
            out.update(family(ClientMetrics.join(tuned), proto, ctx.data.task, "_pruned_finetuned"))
        out.update(self.sparsity(state, ctx.seen))
        return out

    def calibrated(self, ctx, params: dict, clients: np.ndarray) -> dict:
        """The subnetworks (a copy) with each client's BN statistics recomputed over its own
        training data, only where its subnetwork or its data changed since the client's last
        evaluation (the statistics are a pure function of the two: reusing them is exact)."""

        stats = [k for k in stat_names(ctx.model) if k in params]
        params = {k: v.clone() for k, v in params.items()}
        if not stats:
            return params
        keys = [subnet_key(params, i, stats, ctx.data_version) for i in range(len(clients))]
        todo = np.array([i for i, c in enumerate(clients) if self._bn.get(int(c), ("",))[0] != keys[i]], np.int64)
        if len(todo):
            sel = torch.from_numpy(todo).to(next(iter(params.values())).device)
            part = {k: v[sel] for k, v in params.items()}
            with strided_pooling():  # the same values as the model's own max-pool, faster
                calibrate_bn(ctx.model, part, ctx.data.train, np.asarray(clients)[todo])
            for r, i in enumerate(todo):
                self._bn[int(clients[i])] = (keys[i], {k: part[k][r].clone() for k in stats})
        for i, c in enumerate(clients):
            for k in stats:
                params[k][i] = self._bn[int(c)][1][k]
        return params
