"""The memory plan of a step (docs/api.md §9): record one training step with ``ts.record()``,
see where every byte goes (``rec.plan()``), predict what a change would save (``what_if``).

After Apache SINGA's graph mode ("record the first iteration, then plan"): the recorder
(record.py, mode.py, hooks.py, recorder.py) watches one step; the analysis (analysis.py,
whatif.py, summary.py, snapshot.py: plain data, no torch) computes the plan; plot.py draws it
with matplotlib, imported only there. See docs/plan.md.
"""

from __future__ import annotations

from tensorscope.plan.model import BlockCall, Lifetime, MemoryPlan, OpInfo
from tensorscope.plan.record import Recording, record
from tensorscope.plan.whatif import Prediction

__all__ = [
    "BlockCall",
    "Lifetime",
    "MemoryPlan",
    "OpInfo",
    "Prediction",
    "Recording",
    "record",
]
