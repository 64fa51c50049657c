"""Datasets, partition schemes and materialised client data."""

from flockfl.engine.data import ClientData
from flockfl.data.clients import build_client_data
from flockfl.data.dataset import Dataset
from flockfl.data.datasets import load_dataset
from flockfl.data.schemes import SCHEMES, make_partition
from flockfl.data.partition import Partition, resolved_num_clients
from flockfl.data.store import build_or_load

__all__ = ["ClientData", "Dataset", "Partition", "SCHEMES", "build_client_data", "build_or_load", "load_dataset", "make_partition",
           "resolved_num_clients"]
