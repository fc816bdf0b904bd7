"""The benchmarks, run from the repository root as `python -m benchmarks.NAME` (see
docs/benchmarks.md); benchmarks.common holds what they share."""
