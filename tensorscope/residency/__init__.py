"""Residency: a byte budget on the device tier; data moves between device, host and disk.

The package is a few composed objects: the public front and singleton (``manager.py``:
``ts.residency``), the ledger of placements and bytes (``ledger.py``), room-making
(``room.py``), the per-op path (``oppath.py``, multi-tensor splitting in ``split.py``),
placements (``placement.py``), byte moves (``movers.py``), the tiers (``tiers.py``, ``disk.py``),
the prefetch thread (``prefetch.py``) and the report (``report.py``).
"""

from tensorscope._slot import install_residency
from tensorscope.residency.manager import ResidencyManager
from tensorscope.residency.report import ResidencyReport, TierReport, Transfers

__all__ = ["ResidencyManager", "ResidencyReport", "TierReport", "Transfers", "residency"]

residency = ResidencyManager()
install_residency(residency)
