"""Checks and utilities, run from the repository root as `python -m tools.NAME`: exactness
and kernel checks, the planner validation, generation, perplexity plots, the README table."""
