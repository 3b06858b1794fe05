"""The names of the merge strategies, written once.

Invariant: this tuple is the only place the strategy names are listed. ``comm`` implements
them and re-exports the list as ``comm.STRATEGIES`` (what users and the other layers read),
``cost`` prices the merges and picks ``auto``'s, and the run config's ``Literal``, the CLIs,
the benchmarks, the tests and the docs' tables are checked against it.

Why a module of its own: ``comm`` imports ``cost`` (``auto``'s policy), so the list both
read must sit below both; it imports nothing, so the run config can read it without torch.
"""

__all__ = ["MERGES", "STRATEGIES"]

MERGES = ("allreduce3", "packed", "two_level", "allgather", "shifted")
"""The merges ``comm`` implements and ``cost`` prices: every strategy but ``auto`` (docs/design.md §4)."""

STRATEGIES = MERGES + ("auto",)
"""Every value ``tree_decode(strategy=...)`` takes: the merges, and ``auto`` (the cost model's pick)."""
