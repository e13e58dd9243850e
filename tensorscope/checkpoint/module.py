"""``Checkpointable``: a drop-in ``nn.Module`` that trains a Sequential under a memory limit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tensorscope._units import format_bytes, parse_bytes
from tensorscope.checkpoint.chain import Chain, Schedule
from tensorscope.checkpoint.executor import Executor
from tensorscope.checkpoint.explain import explain
from tensorscope.checkpoint.profile import InPlaceLayerError, Profile, flatten, measure
from tensorscope.checkpoint.solver import min_memory, solve, store_all_memory
from tensorscope.errors import InvalidArgumentError, ScheduleError

__all__ = ["LOSS_SCALAR_NBYTES", "RNG_STATE_NBYTES", "Checkpointable"]

#: Bytes of one saved CPU random-number state (``torch.get_rng_state()``); the executor keeps
#: one per recomputed layer that draws random numbers, so on CPU that much is reserved inside
#: the limit for each layer that does (dropout...).
RNG_STATE_NBYTES = 5056

#: Reserved for the scalar loss and autograd's seed gradient (``ones_like(loss)``), both alive
#: during the whole backward, and the executor's scalar gradient placeholder (NOTE [merged
#: backward] in executor.py).
LOSS_SCALAR_NBYTES = 64

_SUB = "tensorscope.checkpoint"

# NOTE [Checkpointable lifecycle]
# First training call (module.training and grad enabled, and something requires grad):
# measure on that batch (profile.py), solve for the limit (solver.py), then run the schedule
# (executor.py). Later calls reuse the schedule; a batch larger than the measured one (in
# bytes), or on another device or dtype, is measured again. Eval mode, torch.no_grad() and
# calls where nothing requires grad run the wrapped Sequential unchanged.
# Limits: bytes are discretised into `slots` units of mem_limit / slots (rotor's default 500;
# NOTE [rounding to slots] in solver.py), and the schedule is checked on the exact sizes, so it
# always fits the real limit; a limit at or above what storing
# everything needs skips the solver. mem_limit=None means: on CUDA the memory free on the device
# when solving (plus the batch itself), on CPU no limit (store everything, no recomputation).


def _layer_fuse(stages: list[nn.Module], k: int) -> None:
    stages[k - 1 : k + 1] = [nn.Sequential(stages[k - 1], stages[k])]


class Checkpointable(nn.Module):
    """Train an ``nn.Sequential`` within ``mem_limit`` by recomputing the fewest activations.

    On the first training call it measures every layer on that batch, solves rotor's dynamic
    program for the fastest schedule that fits, and from then on runs forward and backward
    following it; results and gradients are those of the plain model (dropout masks included,
    BatchNorm statistics updated once). ``mem_limit`` covers the activations, gradients and
    temporaries of the chain -- its input included, parameters and their gradients excluded.

    Args:
        model: an ``nn.Sequential`` (nested Sequentials are flattened); each layer maps one
            tensor to one tensor and must not modify its input in place (an in-place layer is
            fused with the layer before it). A model's ``nn.ModuleList`` of blocks (HF
            ``model.model.layers``) goes to :func:`checkpoint_chain` instead.
        mem_limit: bytes (``int``) or a string such as ``"2GiB"``; ``None``: free device
            memory on CUDA, no limit on CPU.
        slots: the solver measures memory in ``mem_limit / slots`` units (the schedule is then
            checked on exact byte sizes, so it always fits ``mem_limit``).
        preserve_rng_state: replay the random state for recomputed layers (dropout).
        loss_tmp_nbytes: memory your loss needs on top of the model output and its gradient.
        repeats: timed runs per layer when measuring.

    Raises:
        ArgumentTypeError: ``model`` is not an ``nn.Sequential`` (for an ``nn.ModuleList``
            the message names ``checkpoint_chain``).
        InvalidArgumentError: ``mem_limit`` cannot be parsed, or the model has no layer.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
        >>> model = Checkpointable(net, mem_limit="400KiB")
        >>> model(torch.randn(128, 64)).pow(2).mean().backward()
        >>> model.schedule.peak + model.reserved_nbytes <= 400 * 1024
        True
    """

    def __init__(
        self,
        model: nn.Module,
        mem_limit: int | str | None = None,
        *,
        slots: int = 500,
        preserve_rng_state: bool = True,
        loss_tmp_nbytes: int = 0,
        repeats: int = 3,
    ) -> None:
        super().__init__()
        layers = flatten(model)
        if not layers:
            raise InvalidArgumentError(f"{_SUB}: the Sequential has no layer to checkpoint")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise InvalidArgumentError(f"{_SUB}: slots must be a positive int; got {slots!r}")
        if isinstance(loss_tmp_nbytes, bool) or not isinstance(loss_tmp_nbytes, int):
            raise InvalidArgumentError(f"{_SUB}: loss_tmp_nbytes must be an int of bytes")
        self.model = model
        self.mem_limit: int | None = self._parse(mem_limit)
        self.slots = slots
        self.preserve_rng_state = preserve_rng_state
        self.loss_tmp_nbytes = max(0, loss_tmp_nbytes)
        self.repeats = repeats
        self.stages: list[nn.Module] = layers
        self.profile: Profile | None = None
        self.schedule: Schedule | None = None
        self.solved_limit: int | None = None
        self.reserved_nbytes = 0
        self._executor: Executor | None = None
        self._measured: tuple[torch.device, torch.dtype, int, tuple[int, ...]] | None = None

    @staticmethod
    def _parse(mem_limit: int | str | None) -> int | None:
        if mem_limit is None:
            return None
        return parse_bytes(mem_limit, what="mem_limit", subsystem=_SUB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the model; in training with autograd, following the checkpointing schedule."""
        wants_grad = isinstance(x, torch.Tensor) and (
            x.requires_grad or any(p.requires_grad for p in self.model.parameters())
        )
        if not (self.training and torch.is_grad_enabled() and wants_grad):
            out: torch.Tensor = self.model(x)
            return out
        if self._needs_measure(x):
            self.measure(x)
        executor = self._executor or self._solve()  # None if an earlier solve failed: retry
        return executor(x)

    def _needs_measure(self, x: torch.Tensor) -> bool:
        if self._measured is None:
            return True
        device, dtype, nbytes, _ = self._measured
        return x.device != device or x.dtype != dtype or x.nbytes > nbytes

    def measure(self, sample_input: torch.Tensor) -> Profile:
        """Measure every layer on ``sample_input`` and solve for the current limit.

        Runs in training mode with autograd, then restores the random state, the module
        buffers and the training flags. Layers that modify their input in place are fused
        with the layer before them.

        Returns:
            The per-layer :class:`~tensorscope.checkpoint.profile.Profile`.

        Raises:
            ScheduleError: nothing fits ``mem_limit`` (the message gives the least that does).
        """
        stages = list(self.stages)
        while True:
            try:
                prof = measure(stages, sample_input, repeats=self.repeats)
                break
            except InPlaceLayerError as err:
                if err.index == 0:
                    raise
                _layer_fuse(stages, err.index)
        self.stages = stages
        self.profile = prof
        x = sample_input
        self._measured = (x.device, x.dtype, x.nbytes, tuple(x.shape))
        self.compute_sequence()
        return prof

    def _default_limit(self) -> int | None:
        if self._measured is None or self._measured[0].type != "cuda":
            return None
        device = self._measured[0]
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached + self._measured[2])

    def chain(self) -> Chain:
        """The measured chain (bytes, seconds).

        Raises:
            InvalidArgumentError: nothing was measured yet.
        """
        if self.profile is None:
            raise InvalidArgumentError(
                f"{_SUB}: nothing measured yet; call measure(sample_input) or run one training "
                f"step first"
            )
        return self.profile.to_chain(self.loss_tmp_nbytes)

    def compute_sequence(self, mem_limit: int | str | None = None) -> Schedule | None:
        """Solve again, for ``mem_limit`` if given (it becomes the module's limit).

        Before anything is measured this only records the limit and returns ``None``.

        Raises:
            InvalidArgumentError: ``mem_limit`` cannot be parsed.
            ScheduleError: nothing fits; the message gives the smallest limit that does.
        """
        if mem_limit is not None:
            self.mem_limit = self._parse(mem_limit)
        if self.profile is None:
            return None
        self._solve()
        return self.schedule

    def _solve(self) -> Executor:
        self._executor = None
        chain = self.chain()
        limit = self.mem_limit if self.mem_limit is not None else self._default_limit()
        on_cpu = self._measured is not None and self._measured[0].type == "cpu"
        layers = self.profile.layers if self.profile is not None else ()
        rng_layers = [k for k, p in enumerate(layers) if p.uses_rng]
        keep_rng = self.preserve_rng_state and on_cpu
        reserve = LOSS_SCALAR_NBYTES + (RNG_STATE_NBYTES * len(rng_layers) if keep_rng else 0)
        self.reserved_nbytes = reserve
        top = store_all_memory(chain)
        if limit is None or limit - reserve >= top:
            schedule = solve(chain, top)
        else:
            least = min_memory(chain) + reserve
            if limit < least:
                raise self._too_small(limit, least, top + reserve)
            schedule = solve(chain, limit - reserve, slots=self.slots)
        executor = Executor(
            self.stages,
            schedule.ops,
            preserve_rng_state=self.preserve_rng_state,
            rng_layers=rng_layers,
        )
        self.schedule, self.solved_limit = schedule, limit
        self._executor = executor
        return executor

    def _too_small(self, limit: int, least: int, top: int) -> ScheduleError:
        shape = tuple(self._measured[3]) if self._measured is not None else ()
        return ScheduleError(
            f"{_SUB}: no schedule fits mem_limit={format_bytes(limit)} for this "
            f"{len(self.stages)}-layer model on an input of shape {shape}: the smallest limit "
            f"that fits is {format_bytes(least)} ({least} bytes), and storing every activation "
            f"needs {format_bytes(top)}. Raise mem_limit to at least {format_bytes(least)}, use "
            f"a smaller batch, or split the layers with the largest activations."
        )

    def explain(self) -> str:
        """A readable summary of the schedule: per layer what is kept or recomputed, and the
        predicted time overhead and peak memory.

        Example:
            >>> import torch
            >>> m = Checkpointable(torch.nn.Sequential(torch.nn.Linear(4, 4)), mem_limit="1MiB")
            >>> _ = m.measure(torch.randn(2, 4))
            >>> print(m.explain().splitlines()[0])
            Checkpointable: 1 layer, mem_limit 1.0 MiB (at or above what storing everything needs)
        """
        return explain(self)

    def extra_repr(self) -> str:
        limit = "default" if self.mem_limit is None else format_bytes(self.mem_limit)
        return f"mem_limit={limit}, slots={self.slots}"

    @property
    def layers(self) -> Sequence[nn.Module]:
        """The chain's layers as scheduled (flattened; in-place layers fused)."""
        return tuple(self.stages)
