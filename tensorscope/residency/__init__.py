"""Residency: a byte budget on the device tier; data moves between device, host and disk.

The package is a few composed objects: the public front and singleton (``manager.py``:
``ts.residency``; ``ts.manage()``'s side in ``modules.py``), the ledger of placements and bytes
(``ledger.py``), room-making (``room.py``), the per-op path (``oppath.py``; result sizes in
``estimate.py``, multi-tensor splitting in ``split.py``), placements (``placement.py``), byte
moves (``movers.py``), the tiers (``tiers.py``, ``disk.py``, ``mapping.py``; checkpoints in
``checkpoint_files.py`` with their integrity check in ``integrity.py``; the private directory
in ``tempdirs.py``), the prefetch threads (``prefetch.py``), the report (``report.py``), and the
managed classes and what keeps a changing module managed (``managed.py``, ``watch.py``).
"""

from tensorscope._slot import install_residency
from tensorscope.residency.manager import ResidencyManager
from tensorscope.residency.report import ResidencyReport, TierReport, Transfers

__all__ = ["ResidencyManager", "ResidencyReport", "TierReport", "Transfers", "residency"]

residency = ResidencyManager()
install_residency(residency)
