"""Curricula for federated learning (thesis Chapter 2): pacing functions (``pacing``) and the
stage that scores, orders and paces any algorithm's local training (``stage.Curriculum``)."""

from flockfl.curriculum.pacing import Pacing, paced_batches, pacing_size

__all__ = ["Pacing", "paced_batches", "pacing_size"]
