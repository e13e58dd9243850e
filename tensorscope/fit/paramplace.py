"""The block chain's parameters in the disk tier's files between their uses (CPU device). See
NOTE [parameters between their uses].
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from tensorscope._torch import new_storage
from tensorscope._units import format_bytes
from tensorscope.errors import FitWarning, InvalidArgumentError, ResidencyError
from tensorscope.residency.backends import backend_for
from tensorscope.residency.disk import DiskTier
from tensorscope.residency.mapping import DiskRegion
from tensorscope.residency.tiers import move_into_file, swap_in

__all__ = ["MIN_PLACED_BYTES", "ParamPlacer", "measure_mapping", "placeable"]

# NOTE [parameters between their uses]
# When the step does not fit with every parameter resident, ts.fit moves the parameters that
# belong to one block of the chain alone into the disk tier's arena files, as ts.manage does on
# a CPU device (residency/movers.py): each storage's bytes are written to a file region once
# and the file's mapping becomes the storage's memory (`swap_in`: the same storage object, so
# the parameter, its views, the optimizer's references and what autograd saved all follow).
# Around each use of block k -- its forward runs, its backward and the update of its parameters
# inside backward -- the block's pages are mapped in (`MADV_POPULATE_*`, from the page cache
# while it holds them, from the disk otherwise); after it they are dropped (`MADV_DONTNEED`):
# the process's memory falls, the bytes stay in the page cache and the file (an update's dirty
# pages are written back by the kernel). Nothing is copied on the way back, and any other access
# (user code between steps, `state_dict()`, an evaluation forward) reads the mapping: a page
# fault, never a stale or missing value. At most one block's parameters are mapped at a time by
# this schedule. A region's write that fails (a full disk) leaves that parameter in memory
# (FitWarning); a file truncated behind tensorscope's back fails the next mapping with a
# ResidencyError (an access outside the block's runs would fault, as any mapped file's would).
# On CUDA the parameters would need a copy to pinned host memory and back per use: not done.

MIN_PLACED_BYTES = 64 << 10  # smaller parameters (biases, norms) stay: they free little


def placeable(model: nn.Module, blocks: Sequence[nn.Module]) -> list[list[nn.Parameter]]:
    """Per block, the parameters only that block holds (not tied to another module), dense,
    on a device whose memory can be a file mapping (the CPU's backend), at least
    MIN_PLACED_BYTES, and not managed by ``ts.manage``."""
    from tensorscope.manage import ManagedParameter

    maps: dict[torch.device, bool] = {}

    def maps_files(device: torch.device) -> bool:
        found = maps.get(device)
        if found is None:
            try:
                found = maps[device] = backend_for(device).maps_files
            except InvalidArgumentError:  # a device no backend serves (meta)
                found = maps[device] = False
        return found

    owners: dict[int, set[int]] = {}
    inside: dict[int, int] = {}
    for k, block in enumerate(blocks):
        for module in block.modules():
            inside[id(module)] = k
    for module in model.modules():
        where = inside.get(id(module), -1)
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(where)
    out: list[list[nn.Parameter]] = []
    for k, block in enumerate(blocks):
        mine = []
        for p in block.parameters():
            if (
                owners.get(id(p)) == {k}
                and maps_files(p.device)
                and p.layout is torch.strided
                and type(p) is nn.Parameter
                and not isinstance(p, ManagedParameter)
                and p.untyped_storage().nbytes() >= MIN_PLACED_BYTES
            ):
                mine.append(p)
        out.append(mine)
    return out


class ParamPlacer:
    """Parameters of a chain's blocks in files between their uses (see the NOTE).

    ``use(k)`` maps block ``k``'s parameters in, ``done(k)`` drops them. While ``log`` is a
    list (ts.fit sets one for a recorded step, then None), it records what is mapped over time:
    ``(perf_counter seconds, bytes)`` at each change; ``peak_resident`` is the most ever mapped.
    """

    def __init__(self, blocks: Sequence[Sequence[nn.Parameter]], offload_dir: str | None = None):
        self.blocks = [list(params) for params in blocks]
        self.block_nbytes = [sum(p.untyped_storage().nbytes() for p in ps) for ps in self.blocks]
        self._tier: DiskTier | None = None
        self._offload_dir = offload_dir
        self._regions: dict[int, DiskRegion] = {}  # id(param) -> its region
        self._mapped: dict[int, int] = {}  # block -> bytes mapped by use()
        self.resident = 0
        self.peak_resident = 0
        self.log: list[tuple[float, int]] | None = None
        self.placed = False
        self.kept: list[str] = []  # why parameters stayed in memory (failed writes)

    @property
    def directory(self) -> str | None:
        return self._tier.directory if self._tier is not None else None

    @property
    def placed_nbytes(self) -> int:
        """Bytes of parameters in files now."""
        return sum(region.nbytes for region in self._regions.values())

    def place(self) -> None:
        """Move every parameter into a file region (once); its memory goes back now. A write
        that fails (a full disk) leaves that parameter and the ones after it in memory, warns,
        and says why in ``kept``."""
        if self.placed:
            return
        pending = [p for ps in self.blocks for p in ps if id(p) not in self._regions]
        for i, p in enumerate(pending):
            storage = p.untyped_storage()
            try:
                if self._tier is None:  # its files are made (and a page written) here
                    self._tier = DiskTier(self._offload_dir)
                region = move_into_file(self._tier, storage)
            except ResidencyError as exc:
                self.kept.append(str(exc))
                warnings.warn(
                    f"tensorscope.fit: a parameter of {format_bytes(storage.nbytes())} "
                    f"stays in memory, and the {len(pending) - i - 1} after it: {exc}",
                    FitWarning,
                    stacklevel=3,
                )
                break
            region.drop()
            self._regions[id(p)] = region
        self.placed = True
        self.resident = 0
        self._mapped.clear()
        self._note()

    def _note(self) -> None:
        self.peak_resident = max(self.peak_resident, self.resident)
        if self.log is not None:
            self.log.append((time.perf_counter(), self.resident))

    def use(self, k: int, write: bool = False) -> None:
        """Map block ``k``'s parameters in (``write``: they are about to be updated)."""
        if not self.placed or k in self._mapped:
            return
        mapped = 0
        for p in self.blocks[k]:
            region = self._regions.get(id(p))
            if region is None:
                continue
            if not region.populate(write and p.requires_grad):  # a frozen one stays clean
                raise ResidencyError(
                    f"tensorscope.fit: a parameter of block {k} cannot be read from its file "
                    f"in {self.directory} (truncated or changed behind tensorscope's back)."
                )
            mapped += region.nbytes
        self._mapped[k] = mapped
        self.resident += mapped
        self._note()

    def done(self, k: int) -> None:
        """Drop block ``k``'s parameters from memory (the bytes stay in the file)."""
        mapped = self._mapped.pop(k, None)
        if mapped is None:
            return
        for p in self.blocks[k]:
            region = self._regions.get(id(p))
            if region is not None:
                region.drop()
        self.resident -= mapped
        self._note()

    def release(self) -> None:
        """Drop every block mapped in (a step that stopped half-way left them in memory)."""
        for k in list(self._mapped):
            self.done(k)

    def restore(self) -> None:
        """Every parameter back in ordinary memory with its current value; the files go."""
        for params in self.blocks:
            for p in params:
                region = self._regions.pop(id(p), None)
                if region is None:
                    continue
                storage = p.untyped_storage()
                heap = new_storage(storage.nbytes())
                heap.copy_(storage)
                swap_in(storage, heap)  # `heap` now holds the mapping, released below
                del heap
                assert self._tier is not None
                self._tier.release(region, reusable=False)
        self._mapped.clear()
        self.resident = 0
        self.placed = False
        if self._tier is not None:
            self._tier.close()
            self._tier = None


def measure_mapping(offload_dir: str | None = None, nbytes: int = 32 << 20) -> float:
    """Bytes per second of mapping a dropped region back in for writing (``MADV_POPULATE_WRITE``
    from the page cache): what one use of a placed block costs, for the decision's time."""
    tier = DiskTier(offload_dir)
    try:
        data = torch.ones(nbytes, dtype=torch.uint8)
        region = tier.store(data.data_ptr(), nbytes)
        del data
        region.drop()
        start = time.perf_counter()
        region.populate(True)
        seconds = time.perf_counter() - start
        region.drop()
        tier.release(region, reusable=False)
    finally:
        tier.close()
    return nbytes / seconds if seconds > 0 else float(nbytes) * 1e6
