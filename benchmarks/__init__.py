"""Benchmarks and the α-β cost model of context-parallel decoding (entry points; nothing in the
library imports this package).

``decode`` measures every strategy side by side on one process group; ``cold_start``
measures a first call against warm calls (the paper's timing methodology beside the steady
state); ``cost_model`` predicts whole steps from the presets and merge prices of
``megatron_tree.comm.cost`` (the policy ``strategy="auto"`` uses); ``calibrate`` measures this
machine's parameters into ``megatron_tree/comm/presets/cpu_gloo.yaml``.
"""
