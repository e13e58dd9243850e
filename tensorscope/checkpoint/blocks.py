"""``checkpoint_chain``: rotor's schedule for a real model's chain of blocks, installed, removed.

The model keeps its own forward and its own loop over the blocks; each block's call is routed,
while the chain is attached (routes.py), through the chain's executor (blockrun.py).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from tensorscope._units import format_bytes, parse_bytes
from tensorscope.checkpoint.blockprobe import BlockProbe, every_block_ops, retimed
from tensorscope.checkpoint.blockrun import (
    BlockFunction,
    BlockPlan,
    BlockRun,
    Offloader,
    Placer,
)
from tensorscope.checkpoint.calls import drop_caches, split_call, storage_key
from tensorscope.checkpoint.chain import Chain, Schedule
from tensorscope.checkpoint.explain import explain
from tensorscope.checkpoint.find import find_chain
from tensorscope.checkpoint.module import RNG_STATE_NBYTES
from tensorscope.checkpoint.offloaded import OffloadModel, kept_offloaded, with_offload
from tensorscope.checkpoint.profile import Profile
from tensorscope.checkpoint.routes import BlockRoutes, routed
from tensorscope.checkpoint.solver import min_memory, solve, store_all_memory
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError, ScheduleError

__all__ = ["CheckpointedChain", "checkpoint_chain", "find_blocks"]

_SUB = "tensorscope.checkpoint"

# NOTE [routing a model's blocks] lives in routes.py: attach() routes each block's call here,
# remove() gives it back; a block found with HF's gradient checkpointing on is refused: it
# would checkpoint our Functions inside its own.
#
# NOTE [chain lifecycle]
# A call of block 0 in training mode with grad enabled, where the input or a parameter needs
# grad, starts a run. The first run (or one on a larger, other-device or other-dtype input)
# runs the every-block schedule with a BlockProbe attached (blockprobe.py): the step fits
# HF's every-block memory and measures the chain. When its backward finishes, the measured
# chain is solved for mem_limit; a ScheduleError is kept and raised at the next forward (never
# inside autograd's backward, where it would leave gradients half accumulated). Later runs use
# the schedule. Eval mode, no_grad, or nothing needing grad: the blocks run unchanged.
# NOTE [retiming]: the measuring step's times include the storage tracker's per-op cost (a tiny
# GPT-2 block: 19 ms tracked, 2 ms not), which inflates small blocks and favours storing. The
# first scheduled step times every block's Fe and B (each block has exactly one of each in any
# schedule) without the tracker, and the chain is solved again with those times, once.
# mem_limit covers the chain: its input, activations, saved tensors, gradients w.r.t. hidden
# states, transients, the shared context (once), saved random states; plus loss_tmp_nbytes for
# what the model does between the chain's forward and its backward (final norm, head, loss).


# What a run's end may change (CheckpointedChain.mark saves it, abort puts it back).
_MARKED = (
    "profile",
    "schedule",
    "solved_limit",
    "reserved_nbytes",
    "context_nbytes",
    "offloaded",
    "_plan",
    "_error",
    "_retimed",
    "_measured",
    "_context",
)


class CheckpointedChain:
    """A model's block chain trained under ``mem_limit``; see :func:`checkpoint_chain`.

    Attributes:
        path: the chain's dotted path in the model (``"model.layers"``; ``""`` for a list
            passed directly).
        blocks: the blocks, in order.
        profile: per-block measurements (after the first training step), else ``None``.
        schedule: the schedule in use (after the first training step), else ``None``.
        reserved_nbytes: bytes of the limit set aside for the shared context and saved
            random states.
    """

    def __init__(
        self,
        path: str,
        blocks: nn.ModuleList,
        mem_limit: int | str | None,
        *,
        slots: int,
        preserve_rng_state: bool,
        loss_tmp_nbytes: int,
    ) -> None:
        self.path = path
        self.blocks: tuple[nn.Module, ...] = tuple(blocks)
        self.mem_limit = _parse(mem_limit)
        self.slots = slots
        self.preserve_rng_state = preserve_rng_state
        self.loss_tmp_nbytes = loss_tmp_nbytes
        self.profile: Profile | None = None
        self.schedule: Schedule | None = None
        self.solved_limit: int | None = None
        self.reserved_nbytes = 0
        self.context_nbytes = 0
        self.removed = False
        self._plan: BlockPlan | None = None
        self._error: ScheduleError | None = None
        self._run: BlockRun | None = None
        self._plain_step = False
        self._warned_cache = False
        self._retimed = False
        self._measured: tuple[torch.device, torch.dtype, int, tuple[int, ...]] | None = None
        self._context: dict[int, int] = {}
        self.offloader: Offloader | None = None
        self.offload_model: OffloadModel | None = None
        self.offloaded: tuple[int, ...] = ()
        self.placer: Placer | None = None  # where the blocks' parameters are between uses
        # NOTE [selective recomputation] (simulate.py): whether the schedule may run a block as
        # Fs (measured from the next measuring step on; off for compiled blocks, whose kept
        # results Inductor's partitioner already chooses inside the graph)
        self.selective = True
        # NOTE [retiming]: what the re-timed profile becomes before it is solved again (ts.fit
        # across ranks agrees it with the other ranks' first: fit/parts/across.py)
        self.retime_hook: Callable[[Profile], Profile] | None = None
        self._routes = BlockRoutes(self.blocks, self._call)
        # NOTE [retiming compiled blocks]: how many graphs were compiled so far (None: no count)
        self.compiles: Callable[[], int] | None = None
        self._compiles_at = 0
        self._probes: weakref.WeakSet[BlockProbe] = weakref.WeakSet()  # measuring, not done
        self._marked: tuple[Any, ...] | None = None

    @property
    def _forwards(self) -> list[Callable[..., Any]]:
        return self._routes.forwards

    def wrap_forwards(
        self, wrap: Callable[[int, Callable[..., Any]], Callable[..., Any]] | None
    ) -> None:
        """Run ``wrap(k, block k's own forward)`` wherever the chain runs block ``k`` (kept,
        recomputed, offloaded or plain; ts.fit(compile=True) compiles it); None: the own
        forwards again. Call it before the first training step: a schedule solved before keeps
        the forwards it had."""
        self._routes.wrap(wrap)

    @property
    def stages(self) -> tuple[nn.Module, ...]:
        """The blocks (the name :func:`~tensorscope.checkpoint.explain.explain` reads)."""
        return self.blocks

    # -- installation -------------------------------------------------------------------

    def attach(self) -> None:
        """Route the blocks' calls through the chain (NOTE [routing a model's blocks]);
        :func:`checkpoint_chain` does it.

        Raises:
            InvalidArgumentError: a block is routed by another chain, or this one was removed.
        """
        if self.removed:
            raise InvalidArgumentError(f"{_SUB}: this chain was removed; make a new one")
        self._routes.attach(self.path or "the chain")

    def remove(self) -> None:
        """Give every block its own ``forward`` back (idempotent); the model is as before."""
        if self.removed:
            return
        self._routes.detach()
        self.removed = True
        self.abort()

    def mark(self) -> None:
        """Remember what a run's end may change -- the measurements and the schedule solved
        from them -- for :meth:`abort` to put back (``ts.fit`` marks each step's start)."""
        self._marked = tuple(getattr(self, name) for name in _MARKED)

    def abort(self) -> None:
        """Forget the runs in progress (an exception left them, or their backward will never
        run): the next call of block 0 starts again; what their ends changed since
        :meth:`mark` is put back (a measuring run measures again)."""
        self._run = None
        for probe in list(self._probes):
            probe.close()
        self._probes.clear()
        if self._marked is not None:
            for name, value in zip(_MARKED, self._marked, strict=True):
                setattr(self, name, value)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    # -- calls -----------------------------------------------------------------------------

    def _call(self, k: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        block = self.blocks[k]
        if not (block.training and torch.is_grad_enabled()):
            return self._forwards[k](*args, **kwargs)
        args, kwargs, dropped = drop_caches(args, kwargs)
        if dropped and not self._warned_cache:
            self._warned_cache = True
            warnings.warn(
                f"{_SUB}: the model passes a KV cache to its blocks in training "
                f"(use_cache=True); the checkpointed blocks run without it, as HF's gradient "
                f"checkpointing does (set model.config.use_cache = False to silence this)",
                UserWarning,
                stacklevel=2,
            )
        if k == 0:
            self._run, self._plain_step = None, False
            if not self._wants_grad(args) or self._keeps_all(args, kwargs):
                self._plain_step = True
                return self._forwards[k](*args, **kwargs)
            self._run = self._start(args, kwargs)
        run = self._run
        if run is None:
            if self._plain_step:
                return self._forwards[k](*args, **kwargs)
            raise InvalidArgumentError(
                f"{_SUB}: block {k} of {self.path or 'the chain'} was called before block 0 in "
                f"this training step; checkpoint_chain needs the model to call every block, "
                f"in order, once per forward"
            )
        return self._block(run, k, args, kwargs)

    def _block(self, run: BlockRun, k: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = run.plan.names[k]
        try:
            x, call = split_call(k, name, args, kwargs)
            if k != run.next_block or (k > 0 and not run.follows(x)):
                raise InvalidArgumentError(
                    f"{_SUB}: block {k} ({name}) did not get block {k - 1}'s output as its "
                    f"first argument: the model calls the blocks out of order or changes the "
                    f"hidden state between them, so they are not a chain that can be "
                    f"recomputed. Checkpoint another list (blocks=...) or use "
                    f"torch.utils.checkpoint."
                )
            run.calls[k] = call
            run.params[k] = _params(self.blocks[k])
            if run.probe is not None:
                self._count_context(call.tensors(), run)
            outs: tuple[torch.Tensor, ...] = BlockFunction.apply(  # type: ignore[no-untyped-call]
                run, k, x, *call.grad_tensors, *run.params[k]
            )
        except BaseException:
            self._run = None
            raise
        run.alias = weakref.ref(outs[0])
        if k + 1 == len(self.blocks):
            self._run = None
        return run.structure.pop(k).rebuild(outs)

    def _keeps_all(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        # NOTE [a schedule that keeps every block]
        # Once the schedule is timed, one that recomputes, offloads and places nothing is the
        # plain forward and backward: the blocks run as they are, with no autograd Function
        # around each (its saving and bookkeeping cost ~1-2% of a small model's step). A
        # larger batch than the measured one is measured again, as in _start.
        plan, m = self._plan, self._measured
        if plan is None or m is None or plan.rerun or plan.offload or self.placer is not None:
            return False
        if not self._retimed or self._error is not None:
            return False
        x, _ = split_call(0, type(self.blocks[0]).__name__, args, kwargs)
        return (x.device, x.dtype) == m[:2] and x.nbytes <= m[2]

    def _wants_grad(self, args: tuple[Any, ...]) -> bool:
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            return True
        return any(p.requires_grad for b in self.blocks for p in b.parameters())

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BlockRun:
        if self._error is not None:
            raise ScheduleError(str(self._error))  # kept from the measuring step's solve
        x, _ = split_call(0, type(self.blocks[0]).__name__, args, kwargs)
        for block in self.blocks:
            if getattr(block, "gradient_checkpointing", False):
                raise InvalidArgumentError(
                    f"{_SUB}: HF gradient checkpointing is on for {type(block).__name__}; it "
                    f"would checkpoint tensorscope's schedule inside its own. Call "
                    f"model.gradient_checkpointing_disable() before checkpoint_chain."
                )
        m = self._measured
        fits = m is not None and (x.device, x.dtype) == m[:2] and x.nbytes <= m[2]
        if self._plan is not None and fits:
            if self._retimed:
                return BlockRun(self._plan, offloader=self.offloader, placer=self.placer)
            self._compiles_at = self.compiles() if self.compiles is not None else 0
            run = BlockRun(
                self._plan, on_done=self._retime, offloader=self.offloader, placer=self.placer
            )
            run.synchronize = True
            return run
        n = len(self.blocks)
        plan = BlockPlan(self.blocks, self._forwards, every_block_ops(n), range(n))
        self._context = {}
        measured = (x.device, x.dtype, x.nbytes, tuple(x.shape))
        probe = BlockProbe(n, x.device, selective=self.selective)
        self._probes.add(probe)
        return BlockRun(
            plan,
            probe,
            on_done=lambda run: self._finish_measure(run, measured),
            placer=self.placer,
        )

    def _count_context(self, tensors: Sequence[torch.Tensor], run: BlockRun) -> None:
        skip = storage_key(run.plain[0]) if 0 in run.plain else None
        for t in tensors:
            key = storage_key(t)
            if key != skip:
                self._context[key] = int(t.untyped_storage().nbytes())

    def _finish_measure(
        self, run: BlockRun, measured: tuple[torch.device, torch.dtype, int, tuple[int, ...]]
    ) -> None:
        """Called when a measuring run's backward is done: solve for the limit."""
        probe = run.probe
        if not isinstance(probe, BlockProbe):  # pragma: no cover - only measuring runs
            return
        probe.close()
        self._probes.discard(probe)
        self._measured, self._retimed = measured, False
        self.profile = probe.profile(run.plan.names, run.input_nbytes)
        self.context_nbytes = sum(self._context.values())
        # a ScheduleError is kept in self._error: raised at the next forward, shown by explain()
        with contextlib.suppress(ScheduleError):
            self._solve()

    def _retime(self, run: BlockRun) -> None:
        """NOTE [retiming]: the first scheduled step's untracked times replace the measuring
        step's, and the chain is solved again, once."""
        if self._retimed or self.profile is None:
            return
        if self.compiles is not None and self.compiles() != self._compiles_at:
            return  # NOTE [retiming compiled blocks]: the next run re-times
        self._retimed = True
        # an offloaded block's Fe wrote its saved tensors out and its B read them back: not
        # compute (the offload model prices that I/O apart); its alike blocks' times stand in
        # (GPT-2 8x256, six of eight blocks offloaded: 175 ms a forward against 59 ms, and every
        # later prediction was 2.5x the measured step)
        off = set(run.plan.offload)
        fe = {k: s for k, s in run.fe_s.items() if k not in off}
        b = {k: s for k, s in run.b_s.items() if k not in off}
        shares = {k: s / fe[k] for k, s in run.replay_s.items() if fe.get(k)}
        profile = retimed(self.profile, fe, b, shares)
        hook = self.retime_hook
        self.profile = hook(profile) if hook is not None else profile
        with contextlib.suppress(ScheduleError):  # same sizes, same limit: it fits
            self._solve()

    # -- solving -----------------------------------------------------------------------------

    def set_offload(
        self, offloader: Offloader | None, model: OffloadModel | None, blocks: Sequence[int]
    ) -> None:
        """Offload the saved tensors of ``blocks`` (kept by the schedule) through ``offloader``
        from the next solve on (``compute_sequence``); ``model`` says what each block moves
        (checkpoint/offloaded.py). No blocks (or no offloader): nothing is offloaded."""
        if offloader is None or model is None or not blocks:
            self.offloader, self.offload_model, self.offloaded = None, None, ()
        else:
            self.offloader, self.offload_model, self.offloaded = offloader, model, tuple(blocks)

    def chain(self) -> Chain:
        """The measured chain (bytes, seconds); ``loss_tmp`` is ``loss_tmp_nbytes``.

        Raises:
            InvalidArgumentError: nothing was measured yet (run one training step first).
        """
        if self.profile is None:
            raise InvalidArgumentError(
                f"{_SUB}: nothing measured yet; run one training step (forward and backward) "
                f"through the model first"
            )
        return self.profile.to_chain(self.loss_tmp_nbytes)

    def compute_sequence(self, mem_limit: int | str | None = None) -> Schedule | None:
        """Solve again, for ``mem_limit`` if given (it becomes the chain's limit).

        Before the first training step this only records the limit and returns ``None``.

        Raises:
            InvalidArgumentError: ``mem_limit`` cannot be parsed.
            ScheduleError: nothing fits; the message gives the smallest limit that does.
        """
        if mem_limit is not None:
            self.mem_limit = _parse(mem_limit)
        if self.profile is None:
            return None
        self._solve()
        return self.schedule

    def _solve(self) -> None:
        self._plan, self._error, self.schedule = None, None, None
        chain = self.chain()
        prof = self.profile
        if prof is None:  # pragma: no cover - chain() raised
            return
        rng_blocks = [k for k, p in enumerate(prof.layers) if p.uses_rng]
        on_cpu = prof.device.startswith("cpu")
        keep_rng = self.preserve_rng_state and on_cpu
        reserve = self.context_nbytes + (RNG_STATE_NBYTES * len(rng_blocks) if keep_rng else 0)
        self.reserved_nbytes = reserve
        limit = self.mem_limit
        schedule, self.offloaded = kept_offloaded(
            self.offloaded, lambda blocks: self._schedule(chain, reserve, limit, blocks)
        )
        assert schedule is not None  # _schedule raises rather than return None
        self._plan = BlockPlan(
            self.blocks,
            self._forwards,
            schedule.ops,
            rng_blocks if self.preserve_rng_state else (),
            self.offloaded,
        )
        self.schedule, self.solved_limit = schedule, limit

    def _schedule(
        self, chain: Chain, reserve: int, limit: int | None, offloaded: tuple[int, ...]
    ) -> Schedule:
        chain, extra = with_offload(chain, self.offload_model, offloaded)  # NOTE [offload in
        reserve += extra  # rotor's model]
        top = store_all_memory(chain)
        if limit is None or limit - reserve >= top:
            return solve(chain, top)
        least = min_memory(chain) + reserve
        if limit < least:
            self._error = self._too_small(limit, least, top + reserve)
            raise self._error
        return solve(chain, limit - reserve, slots=self.slots)

    def _too_small(self, limit: int, least: int, top: int) -> ScheduleError:
        shape = self._measured[3] if self._measured is not None else ()
        return ScheduleError(
            f"{_SUB}: no schedule fits mem_limit={format_bytes(limit)} for the "
            f"{len(self.blocks)}-block chain {self.path or '(list)'} on a hidden state of shape "
            f"{shape}: the smallest limit that fits is {format_bytes(least)} ({least} bytes), "
            f"and storing every activation needs {format_bytes(top)}. Raise mem_limit to at "
            f"least {format_bytes(least)}, or use a smaller batch or sequence."
        )

    def explain(self) -> str:
        """A readable summary: per block what is kept or recomputed, predicted time and peak.

        Example:
            >>> net = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
            >>> with checkpoint_chain(net, mem_limit="1MiB") as chained:
            ...     print(chained.explain())
            CheckpointedChain: 2 blocks, mem_limit 1.0 MiB; not measured yet: run one training step
        """
        if self._error is not None:
            n = len(self.blocks)
            return f"CheckpointedChain: {n} blocks; {self._error}"
        return explain(
            self,
            title="CheckpointedChain",
            unit="block",
            reserved_what=(
                "the context every block shares (masks, position embeddings), stored once; "
                "saved random states of blocks that draw random numbers"
            ),
            unmeasured="run one training step",
        )

    def __repr__(self) -> str:
        limit = "none" if self.mem_limit is None else format_bytes(self.mem_limit)
        state = "removed" if self.removed else "installed" if self._routes.attached else "new"
        return (
            f"CheckpointedChain({self.path or '<list>'}: {len(self.blocks)} blocks, "
            f"mem_limit={limit}, {state})"
        )


def _params(block: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in block.parameters():
        if p.requires_grad:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _parse(mem_limit: int | str | None) -> int | None:
    if mem_limit is None:
        return None
    return parse_bytes(mem_limit, what="mem_limit", subsystem=_SUB)


def checkpoint_chain(
    model: nn.Module,
    mem_limit: int | str | None = None,
    *,
    blocks: str | None = None,
    slots: int = 500,
    preserve_rng_state: bool = True,
    loss_tmp_nbytes: int = 0,
) -> CheckpointedChain:
    """Train ``model``'s block chain under ``mem_limit`` with rotor's optimal recomputation.

    The chain is the longest ``nn.ModuleList`` of blocks of one class (``model.layers``,
    ``transformer.h``, ``encoder.layer``...), or the list passed as ``model``. The model's own
    forward runs unchanged; its calls of the blocks go through the schedule. The first
    training step checkpoints every block while measuring them, then the chain is solved for
    ``mem_limit``; results and gradients are the plain model's.

    Args:
        model: the model, or its ``nn.ModuleList`` of blocks.
        mem_limit: bytes (``int``) or a string such as ``"2GiB"``: the chain's memory (input,
            activations, saved tensors, hidden-state gradients, transients, shared context),
            not parameters, their gradients or optimizer state. ``None``: no limit on CPU
            (nothing recomputed), the free device memory on CUDA is not assumed (no limit).
        blocks: dotted path of the list to use (``"model.layers"``) instead of finding it.
        slots: the solver measures memory in ``mem_limit / slots`` units.
        preserve_rng_state: replay the random state for recomputed blocks (dropout).
        loss_tmp_nbytes: memory the model needs between the chain's forward and its backward
            beyond the chain output and its gradient (final norm, head, logits, loss).

    Returns:
        The installed :class:`CheckpointedChain`; ``remove()`` it (or use it as a context
        manager) to give the model back.

    Raises:
        ArgumentTypeError: ``model`` is not an ``nn.Module``.
        InvalidArgumentError: no chain (or an ambiguous one), a bad argument, a block already
            routed by another ``checkpoint_chain``, or the same block twice in the list.

    Example:
        >>> from torch import nn
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = nn.ModuleList(
        ...             nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)
        ...         )
        ...     def forward(self, x):
        ...         for layer in self.layers:           # the model's own loop, unchanged
        ...             x = layer(x)
        ...         return x
        >>> net = Net()
        >>> with checkpoint_chain(net, mem_limit="200KiB") as chained:
        ...     for _ in range(2):                     # step 1 measures, step 2 runs the schedule
        ...         net(torch.randn(128, 64)).pow(2).mean().backward()
        ...     chained.schedule.peak + chained.reserved_nbytes <= 200 * 1024
        True
    """
    path, found = find_blocks(model, blocks)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise InvalidArgumentError(f"{_SUB}: slots must be a positive int; got {slots!r}")
    if isinstance(loss_tmp_nbytes, bool) or not isinstance(loss_tmp_nbytes, int):
        raise ArgumentTypeError(f"{_SUB}: loss_tmp_nbytes must be an int of bytes")
    chain = CheckpointedChain(
        path,
        found,
        mem_limit,
        slots=slots,
        preserve_rng_state=preserve_rng_state,
        loss_tmp_nbytes=max(0, loss_tmp_nbytes),
    )
    chain.attach()
    return chain


def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, nn.ModuleList]:
    """The chain :func:`checkpoint_chain` would route: ``(path, blocks)``, checked.

    Raises:
        ArgumentTypeError: ``model`` is not an ``nn.Module``.
        InvalidArgumentError: no chain (or an ambiguous one), no block, a block routed by
            another ``checkpoint_chain``, or the same block twice in the list.
    """
    path, found = find_chain(model, blocks)
    if len(found) == 0:
        raise InvalidArgumentError(f"{_SUB}: the chain {path or '(list)'} has no block")
    ids: dict[int, int] = {}
    for k, block in enumerate(found):
        if id(block) in ids:
            raise InvalidArgumentError(
                f"{_SUB}: block {k} of {path or 'the chain'} is the same module as block "
                f"{ids[id(block)]}; checkpoint_chain needs distinct blocks"
            )
        ids[id(block)] = k
        if routed(block):
            raise InvalidArgumentError(
                f"{_SUB}: block {k} of {path or 'the chain'} is already routed by a "
                f"checkpoint_chain; remove() that one first"
            )
    return path, found
