"""Benchmarks: the tracker micro-benchmark (bench_tracker.py) and the end-to-end harness (run.py)."""
