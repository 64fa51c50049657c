"""Datasets, partition schemes and materialised client data."""

from flockfl.engine.data import ClientData
from flockfl.data.clients import build_client_data
from flockfl.data.datasets import Dataset, load_dataset
from flockfl.data.partition import SCHEMES, Partition, build_or_load, make_partition, resolved_num_clients

__all__ = ["ClientData", "Dataset", "Partition", "SCHEMES", "build_client_data", "build_or_load", "load_dataset", "make_partition",
           "resolved_num_clients"]
