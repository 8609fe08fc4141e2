"""Throughput sweeps, Pareto analysis and the analytical performance model (pure Python, no GPU needed)."""
