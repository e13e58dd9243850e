"""tensorscope: explicit, deterministic control over PyTorch tensor memory.

Public names only (see API.md); no logic here.
"""

from tensorscope.errors import (
    ArgumentTypeError,
    DisposedTensorError,
    InvalidArgumentError,
    LeakWarning,
    OutOfBudgetError,
    ResidencyError,
    ScheduleError,
    ScopeError,
    TensorScopeError,
)

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "DisposedTensorError",
    "InvalidArgumentError",
    "LeakWarning",
    "OutOfBudgetError",
    "ResidencyError",
    "ScheduleError",
    "ScopeError",
    "TensorScopeError",
    "__version__",
]
