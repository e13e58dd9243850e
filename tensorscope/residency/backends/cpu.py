"""The CPU backend: the device is the CPU, the tier below it the disk, and no copy is needed.

A CPU placement's memory becomes its disk region's mapping at its first demotion (a ``pwrite``
of its bytes, then its data pointer swapped to the mapping); from then on moves only drop and
map pages (movers.py, disk.py). So this backend's copies are plain synchronous ``memcpy``s,
used where a CPU storage gets ordinary memory back.
"""

from __future__ import annotations

import torch

from tensorscope._torch import no_dispatch
from tensorscope.residency.backends.base import DONE, Backend, Pending

__all__ = ["CpuBackend"]


class CpuBackend(Backend):
    """The CPU as the device (see the module docstring)."""

    name = "cpu"
    maps_files = True
    heap_device = True
    host_tier = False

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, None)

    def _copy(
        self,
        dst: torch.UntypedStorage,
        src: torch.UntypedStorage,
        *,
        to_device: bool,
        background: bool,
        pinned: bool,
    ) -> Pending:
        with no_dispatch():
            dst.copy_(src)
        return DONE
