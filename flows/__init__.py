"""Prefect flows and the flock command line."""
