"""What the tests share: the multi-rank harness with the tests' preload, checkpoints, launch helpers."""
