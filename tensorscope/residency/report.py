"""What ``ts.residency.report()`` returns: per-tier bytes, peaks, transfers; ``str()`` a table."""

from __future__ import annotations

from dataclasses import dataclass

from tensorscope._units import format_bytes

__all__ = ["ResidencyReport", "TierReport", "Transfers"]


@dataclass(frozen=True)
class TierReport:
    resident_bytes: int
    peak_bytes: int
    placements: int


@dataclass(frozen=True)
class Transfers:
    count: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ResidencyReport:
    """What ``ts.residency.report()`` returns; ``str()`` is a readable table."""

    device: str
    policy: str
    budget_bytes: int | None
    tiers: dict[str, TierReport]
    transfers: Transfers
    prefetches: int
    # Placements whose disk copy is a checkpoint file itself (ts.manage(checkpoint=...)), their
    # bytes, and the stored tensors converted into offload files (their dtype differed).
    checkpoint_placements: int = 0
    checkpoint_bytes: int = 0
    converted: int = 0
    # The disk tier's measured read rate, bytes/s (None until a read was timed): Flow's
    # prefetch depth follows it (policies/flow.py).
    read_rate: float | None = None
    # On CUDA: the caching allocator's reserved and allocated bytes on the device when the
    # report was made (everything the process holds there, managed or not); None elsewhere.
    device_reserved_bytes: int | None = None
    device_allocated_bytes: int | None = None
    # With a host tier (CUDA): pinned host memory the backend holds for copies now, its limit
    # (TENSORSCOPE_PINNED_LIMIT), and the copies that went through pageable memory instead
    # since the process started (the pool was exhausted, or pinning failed: the latest reason).
    pinned_bytes: int | None = None
    pinned_limit_bytes: int | None = None
    pageable_copies: int = 0
    pageable_reason: str | None = None

    @property
    def peak_bytes(self) -> int:
        """Peak of the device tier (the budgeted one)."""
        return self.tiers["device"].peak_bytes

    def __str__(self) -> str:
        budget = "unlimited" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        lines = [
            f"tensorscope residency: device {self.device}, policy {self.policy}, budget {budget}",
            f"  {'tier':<8}{'resident':>12}{'peak':>12}{'tensors':>9}",
        ]
        for name, tier in self.tiers.items():
            lines.append(
                f"  {name:<8}{format_bytes(tier.resident_bytes):>12}"
                f"{format_bytes(tier.peak_bytes):>12}{tier.placements:>9}"
            )
        t = self.transfers
        lines.append(
            f"  transfers: {t.count} moves, {format_bytes(t.bytes)} in {t.seconds:.3f} s; "
            f"{self.prefetches} prefetched"
        )
        if self.device_reserved_bytes is not None:
            lines.append(
                f"  the device's allocator: {format_bytes(self.device_reserved_bytes)} reserved, "
                f"{format_bytes(self.device_allocated_bytes or 0)} allocated (all tensors)"
            )
        if self.pinned_bytes is not None:
            limit = format_bytes(self.pinned_limit_bytes or 0)
            line = f"  pinned host memory: {format_bytes(self.pinned_bytes)} (limit {limit})"
            if self.pageable_copies:
                line += (
                    f"; {self.pageable_copies} copies through pageable memory instead "
                    f"({self.pageable_reason})"
                )
            lines.append(line)
        if self.read_rate is not None:
            lines.append(f"  disk reads measured at {self.read_rate / 1e9:.2f} GB/s")
        if self.checkpoint_placements or self.converted:
            lines.append(
                f"  checkpoint: {self.checkpoint_placements} tensors "
                f"({format_bytes(self.checkpoint_bytes)}) read in place from the checkpoint "
                f"files; {self.converted} converted into offload files (another dtype)"
            )
        return "\n".join(lines)
