"""Benchmarks and the α-β cost model of context-parallel decoding.

``decode`` measures every strategy side by side on one process group; ``cost_model``
predicts the same numbers from a few link and kernel parameters (YAML presets in
``presets/``, written for this machine by ``calibrate``). Importing this package loads
nothing heavy: ``comm.choose_strategy`` imports ``cost_model`` from here on every process.
"""
