"""Benchmarks and workload generators."""
