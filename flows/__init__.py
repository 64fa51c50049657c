"""Prefect flows and the flockfl command line."""
