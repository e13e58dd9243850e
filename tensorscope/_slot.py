"""The residency slot: how the residency manager plugs into refs, disposal and the op path.

The scope core (refs, disposal, the interceptor) sits below the residency package and must not
import it. The manager installs itself here when ``tensorscope.residency`` is imported; the core
calls it through this typed protocol only (DESIGN.md: imports point down).

Layer 4: imports only layers 0-3.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = [
    "ACTIVE",
    "ResidencyHooks",
    "active_residency",
    "install_residency",
    "residency_hooks",
    "set_residency_active",
]


class ResidencyHooks(Protocol):
    """What the core asks of the residency manager."""

    def tier_of(self, tensor: torch.Tensor) -> str:
        """Where ``tensor``'s data is: "device", "host" or "disk"."""
        ...

    def promote(self, tensor: torch.Tensor) -> None:
        """Bring ``tensor``'s data to the device tier."""
        ...

    def demote(self, tensor: torch.Tensor, tier: str | None) -> None:
        """Move ``tensor``'s data down (to ``tier``, default the next one)."""
        ...

    def storages_disposed(self, keys: list[int]) -> None:
        """Refs of these storages were disposed: forget placements nothing else holds."""
        ...

    def run_op(
        self,
        func: Any,
        kind: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        results_due: bool,
    ) -> Any:
        """Run ``func`` with its managed operands resident; manage its results when due."""
        ...

    def iteration_boundary(self) -> None:
        """An optimizer step ended: the trace so far predicts the next iteration."""
        ...


_installed: list[ResidencyHooks] = []


def install_residency(hooks: ResidencyHooks) -> None:
    """Called once by ``tensorscope.residency`` at import."""
    _installed[:] = [hooks]


def residency_hooks() -> ResidencyHooks | None:
    """The installed residency manager, if ``tensorscope.residency`` was imported."""
    return _installed[0] if _installed else None


# Holds the manager while it manages anything: the interceptor then runs every op through it.
ACTIVE: list[ResidencyHooks] = []


def set_residency_active(hooks: ResidencyHooks, active: bool) -> None:
    """The manager has placements (``active``) or none left."""
    ACTIVE[:] = [hooks] if active else []


def active_residency() -> ResidencyHooks | None:
    """The manager, while it manages something."""
    return ACTIVE[0] if ACTIVE else None
