"""Process groups and the collectives on them: ``TreeGroups`` (the CP group and its node levels,
built once and validated), the one set of collective helpers (errors become ``CommError``, traffic
is counted in ``CommStats``) and the one cross-rank agreement check. Nothing here runs attention.
"""

from .collectives import CommError, CommStats, DisagreementError
from .topology import Level, TopologyError, TreeGroups

__all__ = ["TreeGroups", "Level", "TopologyError", "CommError", "CommStats", "DisagreementError"]
