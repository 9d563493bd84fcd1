"""Benchmarks: python -m minagi.bench dispatch [...]."""
