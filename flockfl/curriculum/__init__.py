"""Curricula for federated learning (thesis Chapter 2)."""
