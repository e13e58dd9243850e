"""Device backends (API §12): what differs per device, behind one interface (base.py).

``backend_for(device)`` gives a device's backend: ``CpuBackend`` for the CPU, ``CudaBackend``
for a CUDA device, and ``StrictBackend`` for the CPU when ``TENSORSCOPE_BACKEND=strict`` (a
test backend with CUDA's semantics: strict.py). The variable is read at each call:
``ts.residency.configure()`` and fit's offload read it when they start. One backend is made
per device and kind, on first use: a CUDA device's copy streams and its pinned pool are
shared by the residency manager and fit. This package is the only place that asks what kind of
device it is (tests/residency/test_backends.py checks the sources above it).
"""

from __future__ import annotations

import os
import threading

import torch

from tensorscope.errors import InvalidArgumentError
from tensorscope.residency.backends.base import DONE, Backend, Pending, Refused

__all__ = [
    "DONE",
    "VARIABLE",
    "Backend",
    "Pending",
    "Refused",
    "backend_for",
    "check_device",
    "default_device",
]

VARIABLE = "TENSORSCOPE_BACKEND"
_KINDS = ("", "strict")

_made: dict[tuple[str, str], Backend] = {}
_lock = threading.Lock()


def default_device() -> torch.device:
    """CUDA when present, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def check_device(device: torch.device) -> None:
    """Raise ``InvalidArgumentError`` for a device no backend serves here."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            "tensorscope.residency: device 'cuda' asked for but CUDA is not available; "
            "use device='cpu' (the disk tier then backs the CPU)."
        )
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"tensorscope.residency: device {device} is not supported; use 'cpu' or 'cuda'."
        )


def requested() -> str:
    """The kind ``TENSORSCOPE_BACKEND`` asks for: "" (each device's own) or "strict"."""
    kind = os.environ.get(VARIABLE, "").strip().lower()
    if kind not in _KINDS:
        raise InvalidArgumentError(
            f"tensorscope.residency: {VARIABLE}={kind!r} is not a backend; leave it unset (each "
            "device's own) or set it to 'strict' (the CPU with CUDA's copy semantics, for tests)."
        )
    return kind


def backend_for(device: torch.device | str) -> Backend:
    """The backend of ``device`` (see the module docstring)."""
    device = torch.device(device)
    check_device(device)
    if device.type == "cuda":  # pragma: no cover - needs a CUDA device
        from tensorscope.residency.backends.cuda import CudaBackend

        device = CudaBackend.normalize(device)
    kind = "strict" if device.type == "cpu" and requested() == "strict" else device.type
    key = (kind, str(device))
    with _lock:
        backend = _made.get(key)
        if backend is None:
            backend = _made[key] = _make(kind, device)
    return backend


def _make(kind: str, device: torch.device) -> Backend:
    if kind == "strict":
        from tensorscope.residency.backends.strict import StrictBackend

        return StrictBackend(device)
    if kind == "cuda":  # pragma: no cover - needs a CUDA device
        from tensorscope.residency.backends.cuda import CudaBackend

        return CudaBackend(device)
    from tensorscope.residency.backends.cpu import CpuBackend

    return CpuBackend(device)
