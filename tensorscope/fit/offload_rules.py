"""Which saved tensors activation offload writes out, and what offloading a group costs: pure.

Plain data in, plain data out (no torch): ``offload.py`` describes each tensor autograd saves
with a few facts and asks :func:`decide`; the planner predicts the time of offloading a block
from its bytes and the measured bandwidth (:func:`transfer_seconds`).

# NOTE [what is never offloaded]
# Offloading a tensor pays a write and a read; it saves memory only if the write frees the
# tensor's storage, i.e. if autograd's saved reference was the last one. So:
# - parameters, and views or casts of them (``linear`` saves ``weight.t()``; autocast saves a
#   cached cast): the module holds the storage anyway;
# - the block's context: every tensor argument but the first positional one (HF blocks take
#   ``hidden_states`` first, then masks, ``position_embeddings=(cos, sin)``, ids): the caller
#   holds them for every block of the chain;
# - tensors below ``min_bytes``: the per-tensor cost (a queue hand-off, a ``pwrite``, a
#   ``pread`` and an allocation, ~30-60 us here) beats what they free (docs/design.md section 12);
# - what cannot be rebuilt exactly from bytes, size, stride and offset: other devices, sparse
#   or other layouts, tensor subclasses, conjugate or negative views.
# A storage saved twice (the block's input, read by a layer norm and a residual add; the
# ``split`` views of one ``qkv``) is written once: the saved tensors share one entry.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT_BYTES",
    "DEFAULT_MIN_BYTES",
    "Bandwidth",
    "Decision",
    "GroupStats",
    "OffloadStats",
    "SavedTensorFacts",
    "decide",
    "transfer_seconds",
]

DEFAULT_MIN_BYTES = 1 << 20  # 1 MiB: see the NOTE and docs/design.md section 12
DEFAULT_MAX_IN_FLIGHT_BYTES = 64 << 20  # bytes packed and not yet written before pack waits


class Decision(enum.Enum):
    """What happens to one saved tensor; every value but ``OFFLOAD`` keeps it where it is."""

    OFFLOAD = "offload"
    SMALL = "below min_bytes"
    PARAMETER = "a parameter, a view or a cast of one"
    CONTEXT = "a context argument of the block (held by the caller)"
    UNSUPPORTED = "not rebuildable from its bytes (device, layout, subclass, conj/neg bit)"


@dataclass(frozen=True)
class SavedTensorFacts:
    """What :func:`decide` needs to know about one saved tensor (plain data)."""

    storage_nbytes: int
    parameter: bool = False  # a parameter or buffer's storage, a view of one, a cast of one
    context: bool = False  # its storage is one of the block's context arguments
    supported: bool = True  # same device as the offloader, strided, plain class, no conj/neg


def decide(facts: SavedTensorFacts, min_bytes: int = DEFAULT_MIN_BYTES) -> Decision:
    """Whether to offload one saved tensor (see the NOTE: what is never offloaded).

    Example:
        >>> decide(SavedTensorFacts(storage_nbytes=8 << 20))
        <Decision.OFFLOAD: 'offload'>
        >>> decide(SavedTensorFacts(storage_nbytes=8 << 20, parameter=True)).name
        'PARAMETER'
        >>> decide(SavedTensorFacts(storage_nbytes=4096)).name
        'SMALL'
    """
    if not facts.supported:
        return Decision.UNSUPPORTED
    if facts.parameter:
        return Decision.PARAMETER
    if facts.context:
        return Decision.CONTEXT
    if facts.storage_nbytes < min_bytes:
        return Decision.SMALL
    return Decision.OFFLOAD


def transfer_seconds(
    nbytes: int, bytes_per_second: float, per_tensor_s: float = 0.0, tensors: int = 0
) -> float:
    """Predicted seconds to move ``nbytes`` in ``tensors`` pieces one way at a measured
    bandwidth (``OffloadStats.write_bandwidth`` / ``read_bandwidth`` or
    ``measure_bandwidth()``); ``inf`` for an unknown (zero) bandwidth.

    Example:
        >>> transfer_seconds(1 << 30, 2 * (1 << 30))
        0.5
    """
    if nbytes <= 0:
        return per_tensor_s * tensors
    if bytes_per_second <= 0:
        return float("inf")
    return nbytes / bytes_per_second + per_tensor_s * tensors


@dataclass(frozen=True)
class GroupStats:
    """One group's last forward (plain data): what autograd saved and what was offloaded.

    ``kept`` maps a :class:`Decision`'s name (``"SMALL"``, ``"PARAMETER"``, ...) to the bytes of
    the storages kept for that reason; ``shared_bytes`` are saved tensors whose storage was
    already offloaded (written once, counted once in ``offloaded_bytes``)."""

    group: int
    saved_tensors: int
    offloaded_storages: int
    offloaded_bytes: int
    shared_bytes: int
    kept: dict[str, int]

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept.values())


@dataclass(frozen=True)
class OffloadStats:
    """A snapshot of an offloader's counters (plain data; ``ActivationOffloader.stats()``).

    ``ram_bytes`` are the bytes of offloadable storages the offloader holds in memory now
    (packed and not yet written, or read back and not yet unpacked); ``peak_ram_bytes`` the
    highest value since the offloader was made or ``reset_peak()``. With ``measure_only=True``
    nothing is written, so these are the bytes offloading would have taken out of memory.
    ``tier_bytes``: bytes on the tier now. Waits: seconds the forward waited for writes
    (``pack_wait_s``, the in-flight bound) and the backward for reads (``unpack_wait_s``);
    ``sync_reads``: unpacks that found no prefetch and read inline."""

    tier: str
    groups: dict[int, GroupStats]
    ram_bytes: int
    peak_ram_bytes: int
    tier_bytes: int
    live_entries: int
    bytes_written: int
    write_s: float
    bytes_read: int
    read_s: float
    pack_wait_s: float
    unpack_wait_s: float
    sync_reads: int
    write_errors: int
    last_error: str | None
    trims: int = 0  # times the C heap's free memory was given back (CPU)
    peak_read_ahead_bytes: int = 0  # of peak_ram_bytes' kind: read back, not yet unpacked

    @property
    def write_bandwidth(self) -> float:
        """Measured bytes per second of writing (0.0 before any write)."""
        return self.bytes_written / self.write_s if self.write_s > 0 else 0.0

    @property
    def read_bandwidth(self) -> float:
        """Measured bytes per second of reading back (0.0 before any read)."""
        return self.bytes_read / self.read_s if self.read_s > 0 else 0.0


@dataclass(frozen=True)
class Bandwidth:
    """``measure_bandwidth()``'s result: bytes per second each way and the fixed cost of one
    tensor (``per_tensor_s``: a small write plus a small read, queue hand-offs excluded)."""

    tier: str
    nbytes: int
    write_bytes_per_s: float
    read_bytes_per_s: float
    per_tensor_s: float

    def seconds(self, nbytes: int, tensors: int = 1) -> float:
        """Predicted seconds to write ``nbytes`` in ``tensors`` pieces and read them back."""
        return transfer_seconds(
            nbytes, self.write_bytes_per_s, self.per_tensor_s, tensors
        ) + transfer_seconds(nbytes, self.read_bytes_per_s)
