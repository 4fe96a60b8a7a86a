"""Workloads and baselines for `kvray bench`."""
