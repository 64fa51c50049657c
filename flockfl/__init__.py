"""flockfl: clustered and personalised federated learning.

The engine (this package) is pure PyTorch/NumPy/scikit-learn: it imports neither Prefect
nor MLflow. Orchestration lives in ``tasks/`` and ``flows/``.
"""

__version__ = "0.1.0"
