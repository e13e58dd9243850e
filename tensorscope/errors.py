"""The tensorscope exception hierarchy (docs/api.md §6).

Every error tensorscope raises derives from :class:`TensorScopeError`, and also from the builtin
exception a PyTorch user would expect (``RuntimeError``, ``MemoryError``, ``ValueError``,
``TypeError``), so existing ``except`` clauses keep working. Messages start with the subsystem
(``tensorscope.scope:``, ``tensorscope.residency:``, ``tensorscope.checkpoint:``,
``tensorscope.plan:``, ``tensorscope.fit:``), state the
values involved with human-readable sizes, and say how to fix the problem.

This module imports nothing: it is layer 0.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "DisposedTensorError",
    "FitWarning",
    "InvalidArgumentError",
    "LeakWarning",
    "OutOfBudgetError",
    "PlanError",
    "PlanFileError",
    "ResidencyError",
    "ResidencyWarning",
    "ScheduleError",
    "ScopeError",
    "TensorScopeError",
]


class TensorScopeError(Exception):
    """Root of every error raised by tensorscope."""


class ScopeError(TensorScopeError, RuntimeError):
    """Misuse of a dispose scope: no scope open, a closed scope used, a scope entered twice."""


class DisposedTensorError(ScopeError):
    """A disposed :class:`~tensorscope.TensorRef` was used.

    The message names the tensor (shape, dtype), the scope that disposed it and the file:line of
    user code where it was created.
    """


class ResidencyError(TensorScopeError, RuntimeError):
    """A residency move failed (disk full, unwritable offload dir, truncated file) or was refused.

    The tensor involved keeps its data on the tier it was on before the move.
    """


class OutOfBudgetError(TensorScopeError, MemoryError):
    """An op's operands and result alone exceed the device budget; nothing was lost."""


class ScheduleError(TensorScopeError, ValueError):
    """No checkpointing schedule fits the memory limit; the message says the smallest that would."""


class InvalidArgumentError(TensorScopeError, ValueError):
    """A value passed to tensorscope is out of range or unparsable (a budget of "12 parsecs")."""


class ArgumentTypeError(TensorScopeError, TypeError):
    """An argument of the wrong type was passed to tensorscope (a list where a tensor is needed)."""


class PlanError(TensorScopeError, RuntimeError):
    """Misuse of ``ts.record()`` or a plan: a recording nested in another, ``plan()`` before the
    block ended, a block that ran no op."""


class PlanFileError(PlanError, OSError):
    """A plan's picture or snapshot could not be written (an unwritable or missing directory)."""


class ResidencyWarning(UserWarning):
    """Something went wrong behind the residency manager's back (an offload file truncated)."""


class FitWarning(UserWarning):
    """``ts.fit`` measured a step above its budget (the measuring first step, or a prediction
    that fell short), or an aborted step had already updated parameters; it says what it does
    about it, or which."""


class LeakWarning(UserWarning):
    """Emitted by ``ts.scope(report_leaks=True)`` when refs outlive their scope."""
