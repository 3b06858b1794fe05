"""Aids any tier may use: the host-sync guard (``sync_guard``) and the multi-rank harness
(``testing``) that the tests and the benchmarks share. They import torch only; ``yaml_files``, the
YAML reader of users' files that refuses a repeated key, imports pyyaml only.
"""
