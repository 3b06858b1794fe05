"""Benchmarks: ``python -m benchmarks.<name>`` from the repository root, results in ``benchmarks/results/``.
The multi-rank ones share the tests' harness, ``megatron_tree.utils.testing.run_ranks``; README.md says what each measures."""
