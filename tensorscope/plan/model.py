"""``ts.MemoryPlan``: where every byte of a recorded step went (docs/api.md §9).

Plain data, no torch: a plan can be kept, pickled and compared after the model is gone. The
picture (plot.py, matplotlib) and the memory_viz snapshot (snapshot.py) are made on demand.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorscope.plan.whatif import Prediction

__all__ = ["BlockCall", "Lifetime", "MemoryPlan", "OpInfo"]


@dataclass(frozen=True)
class Lifetime:
    """One storage of the step (a tensor and its views, counted once).

    Attributes:
        index: its position in ``plan.lifetimes``.
        category: one of ``parameter``, ``gradient``, ``optimizer_state``, ``activation``,
            ``temporary``, ``other``.
        nbytes: storage bytes.
        created: the op that made it; -1 when it existed before the step.
        last_use: the last op that read or wrote it (-1: none did).
        freed: the op before which it was freed; None when it outlived the step.
        site: ``"file.py:12 in forward"`` where it was made (first used, if it existed before);
            made by autograd's backward: the forward line whose backward made it, followed by
            ``" (backward)"``.
        shape, dtype, device: of the first tensor seen on it.
        name: the parameter's or buffer's name; for a gradient or optimizer state, the name of
            its parameter ("" when unknown).
        block: the module path running when it was made ("" for none, or the model itself).
        saved_by: the module paths whose forward saved it for backward.
        owner: for a gradient, optimizer state or a temporary of an update, the index of its
            parameter's lifetime; -1 otherwise.
        last_forward_use, first_backward_use, last_backward_use: as named (-1: none).
    """

    index: int
    category: str
    nbytes: int
    created: int
    last_use: int
    freed: int | None
    site: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    name: str = ""
    block: str = ""
    saved_by: tuple[str, ...] = ()
    owner: int = -1
    last_forward_use: int = -1
    first_backward_use: int = -1
    last_backward_use: int = -1

    def alive_at(self, op: int, n_ops: int) -> bool:
        """Whether it holds memory right after op ``op`` (``n_ops``: ops in the step)."""
        end = n_ops if self.freed is None else self.freed
        return max(self.created, 0) <= op < end


@dataclass(frozen=True)
class OpInfo:
    """One op of the step: its name, when it began (seconds since the step began), the user
    line that ran it (for an op of the backward: the forward line whose backward it is), the
    innermost module path running, and its phase (``forward``, ``backward``, ``optimizer``)."""

    name: str
    seconds: float
    site: str
    block: str
    phase: str


@dataclass(frozen=True)
class BlockCall:
    """One call of a module in the step.

    Attributes:
        path: the module's name in the model (``"transformer.h.3"``; ``""``: the model).
        forward: ``(first op, end op)`` of its forward (end exclusive).
        backward: the same for the ops of the backward of its forward ops; None without one.
        forward_s, backward_s: seconds they took (0.0 without a backward).
        inputs, outputs: indices into ``plan.lifetimes`` of the storages it took and returned.
        parent: index of the call it ran inside, -1 for none.
        recompute: it ran during a backward (a recomputation by ``torch.utils.checkpoint``).
        saved_bytes: bytes of activations its forward made that were still alive when its
            forward ended (what it leaves for its backward).
    """

    path: str
    forward: tuple[int, int]
    backward: tuple[int, int] | None
    forward_s: float
    backward_s: float
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    parent: int
    recompute: bool
    saved_bytes: int


@dataclass(frozen=True, eq=False)
class MemoryPlan:
    """Where every byte of a recorded step went. Made by ``rec.plan()`` (``ts.record()``).

    Attributes:
        peak_bytes: storage bytes alive at the step's peak (between two ops; a view counts once).
        peak_op: the op at which it was reached.
        peak_site: the user line running at the peak (``"modeling_gpt2.py:210 in forward"``;
            during a backward, the forward line whose backward ran).
        peak_phase: ``forward``, ``backward`` or ``optimizer``.
        at_peak: bytes per category at the peak; they sum to ``peak_bytes``.
        at_peak_by_tier: with ``ts.manage``, ``{tier: {category: bytes}}`` at the peak (tiers of
            the residency manager: ``device``, ``host``, ``disk``); None otherwise.
        timeline: ``(op, seconds, {category: bytes})`` per op.
        lifetimes: one :class:`Lifetime` per storage.
        ops: one :class:`OpInfo` per op.
        calls: one :class:`BlockCall` per module call, in the order they began.
        optimizer_steps: ``(first op, end op)`` of each optimizer step.
        gradient_readers: ops outside backward and optimizer steps that read gradients
            (``clip_grad_norm_``): freeing gradients at their update would change what they see.
        device: the device whose memory this is (the one holding the parameters).
        seconds: the step's duration, recording included.

    Example:
        >>> import torch, tensorscope as ts
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 64))
        >>> x = torch.randn(32, 64)
        >>> with ts.record() as rec:
        ...     model(x).square().mean().backward()
        >>> plan = rec.plan()
        >>> plan.peak_phase, plan.at_peak["parameter"] == (64 * 256 + 256 + 256 * 64 + 64) * 4
        ('backward', True)
        >>> [life.name for life in plan.largest_at_peak(2) if life.category == "parameter"]
        ['0.weight', '2.weight']
        >>> plan.blocks
        ['', '0', '1', '2']
    """

    peak_bytes: int
    peak_op: int
    peak_site: str
    peak_phase: str
    at_peak: dict[str, int]
    at_peak_by_tier: dict[str, dict[str, int]] | None
    timeline: list[tuple[int, float, dict[str, int]]]
    lifetimes: list[Lifetime]
    ops: list[OpInfo]
    calls: list[BlockCall]
    optimizer_steps: list[tuple[int, int]]
    gradient_readers: list[str]
    device: str
    seconds: float
    module_ids: dict[int, str] = field(default_factory=dict, repr=False)

    # --------------------------------------------------------------------------- queries
    @property
    def blocks(self) -> list[str]:
        """The module paths that ran, in the order they first ran (``what_if`` takes these)."""
        return list(dict.fromkeys(call.path for call in self.calls if not call.recompute))

    def alive_at(self, op: int) -> list[Lifetime]:
        """The storages holding memory right after op ``op`` on the plan's device."""
        n = len(self.ops)
        return [
            life
            for life in self.lifetimes
            if life.device == self.device and life.nbytes and life.alive_at(op, n)
        ]

    def largest_at_peak(self, count: int = 10) -> list[Lifetime]:
        """The ``count`` largest storages alive at the peak, largest first."""
        alive = self.alive_at(self.peak_op)
        return sorted(alive, key=lambda life: (-life.nbytes, life.index))[:count]

    def bytes_of(self, category: str) -> int:
        """Bytes of ``category`` at the peak (``plan.at_peak[category]``)."""
        return self.at_peak.get(category, 0)

    # ------------------------------------------------------------------------- prediction
    def what_if(
        self,
        *,
        free_gradients: bool = False,
        recompute: Iterable[Any] = (),
        offload: Iterable[Any] = (),
        reshard_after_forward: bool | None = None,
    ) -> Prediction:
        """The peak this step would have after a change, computed from the lifetimes (no rerun).

        Args:
            free_gradients: each gradient is freed as soon as its parameter's update is applied
                (the optimizer steps each parameter inside backward, as with
                ``register_post_accumulate_grad_hook``).
            recompute: blocks (module paths such as ``"transformer.h.3"``, or the modules
                themselves) whose activations are recomputed in backward instead of kept
                (``torch.utils.checkpoint``); a container that never ran itself (an
                ``nn.ModuleList`` such as ``"transformer.h"``) stands for its children.
            offload: blocks whose saved activations leave the device after their last forward
                use and come back when their backward first needs them.
            reshard_after_forward: under FSDP2, ``False``: every group's gathered parameters
                stay from its forward to its backward (not gathered again); ``True``: freed
                after the forward and gathered again for the backward; ``None``: as recorded.

        Returns:
            a :class:`~tensorscope.plan.whatif.Prediction` (``peak_bytes``, ``at_peak``,
            ``saved_bytes``, ``notes``).

        Raises:
            InvalidArgumentError: a block that did not run in the recorded step (the message
                lists the names that did).

        Example:
            >>> import torch, tensorscope as ts
            >>> block = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
            >>> model = torch.nn.Sequential(*[block() for _ in range(4)])
            >>> with ts.record() as rec:
            ...     model(torch.randn(4096, 64)).sum().backward()
            >>> plan = rec.plan()
            >>> print(plan.what_if(recompute=["1", "2"]))  # GELU's saved inputs: 1 MiB each
            predicted peak 7.1 MiB (2.0 MiB less than recorded)
              - 1 recomputed in backward
              - 2 recomputed in backward
        """
        from tensorscope.plan.whatif import predict

        return predict(
            self,
            free_gradients=free_gradients,
            recompute=recompute,
            offload=offload,
            reshard_after_forward=reshard_after_forward,
        )

    # ---------------------------------------------------------------------------- outputs
    def __str__(self) -> str:
        from tensorscope.plan.summary import summary

        return summary(self)

    def __repr__(self) -> str:
        return (
            f"<MemoryPlan peak {self.peak_bytes} B at op {self.peak_op} of {len(self.ops)} "
            f"({self.peak_phase}) {self.peak_site!r}>"
        )

    def save_png(self, path: Any, *, title: str | None = None) -> None:
        """A stacked-area chart of the step's memory by category, the peak marked and labelled.

        Needs matplotlib (``pip install "tensorscope[plot]"``).

        Raises:
            ImportError: matplotlib is not installed (the message names the extra).
            PlanFileError: ``path`` cannot be written.
        """
        from tensorscope.plan.plot import save_png

        save_png(self, path, title=title)

    def save_snapshot(self, path: Any) -> None:
        """The step as a ``torch.cuda.memory._dump_snapshot`` pickle, for PyTorch's memory_viz
        viewer (https://pytorch.org/memory_viz) and ``torch.cuda._memory_viz``; CPU plans too.

        Raises:
            PlanFileError: ``path`` cannot be written.
        """
        from tensorscope.plan.snapshot import save_snapshot

        save_snapshot(self, path)
