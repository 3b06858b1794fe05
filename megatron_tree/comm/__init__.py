"""Merging partial attention states across ranks: the strategies (``merge``), their α–β prices and
``auto``'s policy (``cost``, with the machine ``presets/``), the measurement that fits a preset
(``calibrate``), and the ring / all-gather baselines they are compared against (``baselines``).
"""

from ..distributed.collectives import CommError, CommStats, DisagreementError
from .strategies import STRATEGIES

__all__ = ["STRATEGIES", "CommError", "CommStats", "DisagreementError"]
