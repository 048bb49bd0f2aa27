"""The maintainers' tools, run as modules from the repository root (`python -m tools.<name>`):
what made the pictures in docs/, the GPU check list, the fused kernels' compile report, and two
benchmarks whose answers are now defaults (their figures: docs/benchmarks.md)."""
