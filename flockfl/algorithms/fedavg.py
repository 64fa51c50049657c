"""FedAvg — McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", https://arxiv.org/abs/1602.05629.

Clients run ``train.local_epochs`` epochs (or ``train.local_steps`` steps) of minibatch SGD
with batch ``train.batch_size`` and step ``train.lr``; the server takes the mean of the
client models weighted by their sample counts (``algorithm.weighting=uniform`` for an
unweighted mean). All behaviour is the :class:`Algorithm` default.
"""

from flockfl.algorithms.base import Algorithm


class FedAvg(Algorithm):
    name = "fedavg"
