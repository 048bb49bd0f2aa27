"""Benchmarks, run as scripts from the repository root: `python bench/<name>.py [--quick]`."""
