"""flockfl: clustered and personalised federated learning.

The engine (this package) is pure PyTorch/NumPy/scikit-learn: it imports neither Prefect
nor MLflow. Orchestration lives in ``tasks/`` and ``flows/``.
"""

import os

# MKL's reproducible mode must be chosen before torch loads it (see flows/env.py); it only
# takes effect when flockfl is imported before torch.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
