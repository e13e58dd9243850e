"""The process group a distributed fit agrees in: its collectives, and a tensorscope error on one
rank raised on every rank (NOTE [errors across ranks]).

# NOTE [errors across ranks]
# A fit's collectives run only at its agreement points, which every rank reaches at the same
# moment of the same step: ``ts.fit()`` itself, the end of the measured step (the decision),
# the start of each step (the batch, a rank that left), the re-timed step and the step whose
# peak is checked. At each point a rank first does its own work (a check, a measurement); a
# tensorscope error there is not raised at once -- the other ranks would wait in the collective
# for ever -- but sent: every rank gets every rank's outcome and, if one failed, raises the
# same error (its type, its message, the rank it came from). So a bad budget on rank 1, or a
# ``ScheduleError`` one rank's measurements would give, ends ``ts.fit``/the step on all ranks
# with one clear error, never a hang in a collective fit started. Errors that are not
# tensorscope's (a bug, a ``KeyboardInterrupt``) propagate at once, as in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from tensorscope import errors
from tensorscope.errors import InvalidArgumentError, TensorScopeError

__all__ = ["Ranks"]

T = TypeVar("T")
_SUB = "tensorscope.fit"


def _initialized() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


class Ranks:
    """The default process group, as a fit agrees in it.

    Attributes:
        world: ranks in the group.
        rank: this process's rank.
        backend: the group's backend (``"gloo"``, ``"nccl"``).
    """

    def __init__(self) -> None:
        dist = torch.distributed
        self.world = int(dist.get_world_size())
        self.rank = int(dist.get_rank())
        self.backend = str(dist.get_backend())

    @staticmethod
    def here() -> Ranks | None:
        """The default process group if one of more than one rank is initialized (else None)."""
        if not _initialized() or int(torch.distributed.get_world_size()) < 2:
            return None
        return Ranks()

    def __repr__(self) -> str:
        return f"<Ranks rank {self.rank} of {self.world} ({self.backend})>"

    def check(self) -> None:
        """Raise if the group is gone (``destroy_process_group()`` while the fit is attached).

        Raises:
            InvalidArgumentError: it was destroyed.
        """
        if not _initialized():
            raise InvalidArgumentError(
                f"{_SUB}: the process group this fit agrees in ({self.world} ranks, "
                f"{self.backend}) was destroyed while the fit was attached; call fit.remove() "
                f"on every rank before torch.distributed.destroy_process_group()"
            )

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        self.check()
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, value)
        return out

    def most(self, values: Sequence[int]) -> list[int]:
        """The largest of each of ``values`` over the ranks (one small all-reduce)."""
        self.check()
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self._device())
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return [int(v) for v in tensor.tolist()]

    def agree(self, local: Callable[[], T]) -> list[T]:
        """Run ``local()`` here, then give every rank every rank's result; a tensorscope error
        on any rank is raised on all of them (NOTE [errors across ranks]).

        Raises:
            TensorScopeError: the first failing rank's error, rebuilt with its type and message.
        """
        failed: TensorScopeError | None = None
        try:
            sent: tuple[str, Any] = ("ok", local())
        except TensorScopeError as exc:
            failed = exc
            sent = ("error", (type(exc).__name__, str(exc)))
        got = self.gather(sent)
        for rank, (kind, payload) in enumerate(got):
            if kind == "error":
                name, message = payload
                raise _rebuilt(name, message, rank, self.world) from failed
        return [payload for _, payload in got]


def _rebuilt(name: str, message: str, rank: int, world: int) -> TensorScopeError:
    """The error ``rank`` raised, as every rank raises it."""
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, TensorScopeError)):
        cls = TensorScopeError
    return cls(f"{message} [raised on rank {rank} of {world}; every rank raises it]")
