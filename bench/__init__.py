"""Benchmarks for ziplog (``python -m bench <experiment>``)."""
