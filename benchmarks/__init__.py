"""The benchmarks, run from the checkout's root as `python -m benchmarks.<area>.<name>` (docs/benchmarks.md has
every command and what it measured). One harness (`harness.py`) launches, waits, kills and interleaves for all;
the areas are folders by what they measure, the training scripts they launch by path are in `workloads/`, and the
results docs/benchmarks.md quotes are in `results/`.
"""
