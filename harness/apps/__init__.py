"""Flower apps the tests and benchmarks run besides the real one (server/, client/)."""
