"""Benchmarks behind BENCHMARKS.md: `nox -s bench` (never part of the default test run)."""
