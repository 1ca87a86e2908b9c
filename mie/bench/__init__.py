"""Benchmarks: ``python -m mie.bench``."""
