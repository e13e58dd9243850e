"""tensorscope: explicit, deterministic control over PyTorch tensor memory.

Public names only (see docs/api.md); no logic here.
"""

from typing import TYPE_CHECKING, Any

from tensorscope import checkpoint
from tensorscope.empty_init import empty_init
from tensorscope.errors import (
    ArgumentTypeError,
    DisposedTensorError,
    FitWarning,
    InvalidArgumentError,
    LeakWarning,
    OutOfBudgetError,
    PlanError,
    PlanFileError,
    ResidencyError,
    ResidencyWarning,
    ScheduleError,
    ScopeError,
    TensorScopeError,
)
from tensorscope.fit import fit
from tensorscope.manage import ManagedModule, ManagedParameter, manage
from tensorscope.plan import MemoryPlan, record
from tensorscope.policies import Flow, Genoa, Policy
from tensorscope.ref import DisposedTensor, TensorRef, dispose, ref
from tensorscope.residency import ResidencyManager, ResidencyReport, residency
from tensorscope.scope import (
    DisposeScope,
    LeakRecord,
    Stats,
    current_scope,
    dispose_everything,
    dispose_everything_but,
    reset_stats,
    scope,
    stats,
)

if TYPE_CHECKING:
    from tensorscope.fit.handle import Fit

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "DisposeScope",
    "DisposedTensor",
    "DisposedTensorError",
    "Fit",
    "FitWarning",
    "Flow",
    "Genoa",
    "InvalidArgumentError",
    "LeakRecord",
    "LeakWarning",
    "ManagedModule",
    "ManagedParameter",
    "MemoryPlan",
    "OutOfBudgetError",
    "PlanError",
    "PlanFileError",
    "Policy",
    "ResidencyError",
    "ResidencyManager",
    "ResidencyReport",
    "ResidencyWarning",
    "ScheduleError",
    "ScopeError",
    "Stats",
    "TensorRef",
    "TensorScopeError",
    "__version__",
    "checkpoint",
    "current_scope",
    "dispose",
    "dispose_everything",
    "dispose_everything_but",
    "empty_init",
    "fit",
    "manage",
    "record",
    "ref",
    "reset_stats",
    "residency",
    "scope",
    "stats",
]


def __getattr__(name: str) -> Any:
    # NOTE [a light import]: ts.fit is a small function; the machinery behind it (and the Fit
    # class) is imported at its first use.
    if name == "Fit":
        from tensorscope.fit.handle import Fit

        return Fit
    raise AttributeError(f"module 'tensorscope' has no attribute {name!r}")
