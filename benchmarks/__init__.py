"""The benchmarks, run from the repository root as `python -m benchmarks.NAME` (see
docs/benchmarks.md); benchmarks.harness holds what they share."""
