"""The benchmarks of autoflat, and the harness they share with `examples/` (`harness.py`)."""
