"""The CUDA backend: pinned host pool, a copy stream per direction, events, ``record_stream``.

The rules it relies on are base.py's NOTE [the copy rules]; the strict backend (strict.py)
checks them on the CPU, and ``tensorscope check``'s ``moves`` check runs this code on a GPU
(docs/accelerators.md). Nothing here stalls the host for the whole device: a copy waits for the
compute stream on the GPU, its consumer waits for its event.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorscope._torch import cuda_event, cuda_stream, no_dispatch, tensor_over
from tensorscope.residency.backends.base import DONE, Backend, Pending
from tensorscope.residency.backends.pinned import PinnedPool, default_limit

__all__ = ["CudaBackend", "CudaPending"]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return tensor_over(storage, torch.uint8, (storage.nbytes(),))


class CudaPending:  # pragma: no cover - needs a CUDA device
    """A copy queued on a copy stream, and the event recorded after it."""

    __slots__ = ("_device", "_event", "_keep")

    def __init__(self, event: torch.cuda.Event, device: torch.device, keep: Any) -> None:
        self._event = event
        self._device = device
        self._keep = keep  # the host memory it uses lives as long as the copy may (rule 5)

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def synchronize(self) -> None:
        self._event.synchronize()  # this copy only, not the whole device
        self._keep = None


class CudaBackend(Backend):  # pragma: no cover - needs a CUDA device
    """A CUDA device (see the module docstring)."""

    name = "cuda"
    maps_files = False
    heap_device = False
    host_tier = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(self.normalize(device), PinnedPool(self._pin, default_limit()))
        self._in = cuda_stream(self.device)  # host to device: promotions, prefetches, reads
        self._out = cuda_stream(self.device)  # device to host: demotions, offloaded tensors

    @staticmethod
    def normalize(device: torch.device) -> torch.device:
        """``cuda`` names the current device: its index, so that one backend serves both."""
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def _pin(self, nbytes: int) -> torch.UntypedStorage:
        with no_dispatch():
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()

    def _copy(
        self,
        dst: torch.UntypedStorage,
        src: torch.UntypedStorage,
        *,
        to_device: bool,
        background: bool,
        pinned: bool,
    ) -> Pending:
        compute = torch.cuda.current_stream(self.device)
        with no_dispatch():
            if to_device and not background:
                # On the compute stream: ordered before every op after it. A pinned source is
                # kept by torch's host allocator until the copy ran (it records the event).
                dst.copy_(src, non_blocking=pinned)
                return DONE
            stream = self._in if to_device else self._out
            stream.wait_stream(compute)  # rule 2
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=pinned)  # pageable: blocking (rule 6)
            if not pinned:
                return DONE
            device_side = dst if to_device else src
            if device_side.nbytes():
                # Rule 4: given back before the copy ran, the block waits for this stream.
                _bytes(device_side).record_stream(stream)
            event = cuda_event()
            event.record(stream)
        return CudaPending(event, self.device, (dst, src))

    def claim(self, storage: torch.UntypedStorage) -> None:
        """The current stream uses ``storage`` from now on: memory allocated on another
        thread's stream (a read on fit's reader thread) is not reused before this stream's
        work on it is done."""
        if storage.nbytes():
            _bytes(storage).record_stream(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocator_bytes(self) -> tuple[int | None, int | None]:
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return None, None
        return torch.cuda.memory_reserved(self.device), torch.cuda.memory_allocated(self.device)

    def reset_allocator_peaks(self) -> None:
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocator_peaks(self) -> tuple[int | None, int | None]:
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return None, None
        device = self.device
        return torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device)
