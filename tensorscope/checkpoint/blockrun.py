"""Run a checkpointing schedule over a chain of blocks called by the model's own loop.

The model calls each block in turn; each call is one autograd ``Function`` that runs the
block's first forward op (``Fn``, ``Fck`` or ``Fe``) and whose backward runs the schedule's ops
up to that block's ``B``. See NOTE [a Function per block].
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from tensorscope.checkpoint.calls import BlockCall, BlockOutput, split_output
from tensorscope.checkpoint.chain import Op, forward_runs
from tensorscope.checkpoint.executor import (
    _autocast,
    _autocast_state,
    _Root,
    _root,
    rerun_guard,
)
from tensorscope.checkpoint.selective import Diverged, Keep, Replay
from tensorscope.errors import InvalidArgumentError

__all__ = ["BlockFunction", "BlockPlan", "BlockRun", "Placer", "Probe"]

_PREFIX = "tensorscope.checkpoint:"

# NOTE [a Function per block]
# Before the loss, a schedule runs every layer exactly once, in order (solver.py), so the
# model's loop can drive the forward phase: block k's call runs op `first[k]` of the schedule.
# Block k's call is one autograd Function (inputs: the hidden state x_k, the context tensors
# that require grad, block k's parameters; outputs: x_{k+1} and the block's other tensors).
# Autograd calls these Functions' backwards in the order L-1, ..., 0 (each needs the next one's
# input gradient), and Function k's backward runs the schedule's ops from where the previous
# one stopped up to B(k): the recomputations B(k) needs, then B(k) itself. So the model sees
# real values between blocks (hooks, output_hidden_states), parameter gradients are
# accumulated block by block as in plain autograd, and d[k+1] -- the incoming gradient of
# Function k -- dies when B(k) returns, as the memory model says (NOTE [memory model]).
# The values the model sees are detached aliases (same storage, no extra memory) of what the
# run keeps: the run must not hold a tensor whose grad_fn is its own Function (a cycle), and
# Fe(k)'s output keeps its inner graph, which B(k) differentiates through its GradientEdge.
# Block k+1's input must be the very alias returned by block k (checked): a model that changes
# the hidden state between blocks is not a chain the schedule can recompute.
# Random state, BatchNorm statistics and autocast: as in executor.py (NOTE [executing a
# schedule]): recomputed blocks replay the RNG state of their first run, run with BatchNorm's
# track_running_stats cleared, and re-enter the forward's autocast state.


# NOTE [offloaded blocks]
# A block in plan.offload is one the schedule keeps (runs once, as Fe in the forward): its Fe
# runs inside the offloader's group k, so what autograd saves goes to the next tier as it is
# written (checkpoint/offloaded.py, NOTE [offload in rotor's model]) -- but not its input x_k
# (the run holds it until B(k) anyway: writing it would free nothing and read a second copy
# back), the block's context tensors, parameters or buffers. When autograd reaches Function k,
# groups k and k-1 are read back on the offloader's reader thread: k-1's read overlaps B(k).
# Recomputations in the backward are not offloaded (what they save is used at once).


# NOTE [placed parameters]
# With a placer (ts.fit, fit/paramplace.py), block k's parameters are mapped in before each of
# its forward ops and dropped after those of the model's forward and after a recomputation of
# another block than the one whose B comes next; before B(k) they are mapped in for writing
# (the update inside backward follows B(k)), and dropped when autograd reaches the next block
# (block k's updates run as soon as its gradients are accumulated, before Function k-1), or,
# for block 0, when autograd reaches the chain's input (a hook on x_0: after block 0's updates,
# before the embedding's backward; not on a leaf, which would keep one hook per step), else when
# the whole backward has finished (an engine callback). Parameters dropped too early are read
# back by a page fault: a mistimed drop costs time, never a value.


# NOTE [context gradients in plain autograd's order]
# A context tensor that requires grad and reaches several blocks (a T5 decoder's
# encoder_hidden_states, read by each block's cross-attention keys and values) gets in plain
# autograd one gradient, accumulated in arrival order: ((s + a_k) + b_k) where s is what the
# later blocks gave and a_k, b_k the two uses in block k. Block k's backward here sums its own
# uses first: s + (a_k + b_k), other bits. So the run carries s itself: B(k) differentiates one
# more root, an alias of the context leaf made at backward time (the newest node, so autograd
# runs it first) with s as its gradient, which puts s in the leaf's buffer before block k's own
# terms arrive, in their plain order; the sum is kept for the next block, and only the first
# block that takes the tensor (the last backward to see it) returns it to autograd, whose
# buffer then holds that one term. Bit-identical to plain when the chain's blocks are the
# tensor's only readers (as in encoder-decoders); a reader outside the chain is added once.


class Probe(Protocol):
    """What measures a run (``blockprobe.BlockProbe``): a window around every op."""

    def forward(self, kind: str, k: int) -> contextlib.AbstractContextManager[Callable[..., None]]:
        """Window around block ``k``'s forward op; yields ``seen(hidden_output)``."""

    def backward(self, k: int) -> contextlib.AbstractContextManager[Callable[..., None]]:
        """Window around ``B(k)``; yields ``seen(input_grad, param_grads)``."""


class Offloader(Protocol):
    """Where offloaded blocks' saved tensors go (``fit.offload.ActivationOffloader``)."""

    def group(
        self, group: int, context: Iterable[torch.Tensor] = ()
    ) -> contextlib.AbstractContextManager[Any]:
        """Saved tensors inside belong to ``group``; ``context`` tensors are never moved."""

    def prefetch(self, group: int) -> None:
        """Start reading ``group``'s saved tensors back."""


class Placer(Protocol):
    """Where the blocks' parameters are between their uses (``fit.paramplace.ParamPlacer``;
    NOTE [placed parameters])."""

    def use(self, k: int, write: bool = False) -> None:
        """Block ``k``'s parameters are about to be used (``write``: and updated)."""

    def done(self, k: int) -> None:
        """Block ``k``'s parameters are not needed until its next use."""


class BlockPlan:
    """What does not change between steps: the blocks, the schedule, who is recomputed, whose
    saved tensors are offloaded (``offload``: blocks the schedule keeps; NOTE [offloaded
    blocks])."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        forwards: Sequence[Callable[..., Any]],
        ops: Sequence[Op],
        rng_blocks: Collection[int],
        offload: Collection[int] = (),
    ) -> None:
        self.blocks = list(blocks)
        self.forwards = list(forwards)
        self.names = [type(b).__name__ for b in self.blocks]
        self.ops = tuple(ops)
        n = len(self.blocks)
        split = self.ops.index(("Loss",))
        first = [op[0] for op in self.ops[:split]]
        if [op[1] for op in self.ops[:split]] != list(range(n)):  # type: ignore[misc]
            raise ValueError(f"{_PREFIX} a schedule must run blocks 0..{n - 1} before the loss")
        self.first = first
        self.backward_ops = list(self.ops[split + 1 :])
        # NOTE [selective recomputation]: a block run by Fs runs again (its replay) as a
        # recomputed one does: its random state saved, BatchNorm statistics left alone
        self.selective = frozenset(op[1] for op in self.ops if op[0] == "Fs")  # type: ignore[misc]
        self.rerun = {k for k, r in forward_runs(self.ops).items() if r > 1} | self.selective
        self.offload = frozenset(offload) - self.rerun
        self.replay_rng = self.rerun.intersection(rng_blocks)
        self.batchnorms = [
            [m for m in b.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
            for b in self.blocks
        ]


@dataclass
class _Graph:
    """Autograd state of one Fe(k): its leaves and the roots B(k) differentiates; of an Fs(k),
    its input and the kept results (``kept``) B(k) replays it with."""

    inp: torch.Tensor
    ctx: list[torch.Tensor]
    roots: list[_Root]
    kept: list[tuple[tuple[Any, ...], Any]] | None = None


class BlockRun:
    """State of one forward/backward of the chain (one per model call)."""

    def __init__(
        self,
        plan: BlockPlan,
        probe: Probe | None = None,
        *,
        on_done: Callable[[BlockRun], None] | None = None,
        offloader: Offloader | None = None,
        placer: Placer | None = None,
    ) -> None:
        self.plan = plan
        self.placer = placer
        self.probe = probe
        self.on_done = on_done
        self.offloader = offloader if plan.offload else None
        self.synchronize = False  # CUDA: synchronize around timed ops (the retiming step)
        self.input_nbytes = 0
        self.fe_s: dict[int, float] = {}  # seconds of each block's Fe, and of its B
        self.b_s: dict[int, float] = {}
        self.replay_s: dict[int, float] = {}  # seconds of each Fs(k)'s replay in B(k)
        self.plain: dict[int, torch.Tensor] = {}  # x_k from Fn/Fck, and the input x_0
        self.outs: dict[int, torch.Tensor] = {}  # x_k as the output of Fe(k-1)
        self.graph: dict[int, _Graph] = {}  # k+1 -> Fe(k)'s autograd state
        self.calls: dict[int, BlockCall] = {}
        self.structure: dict[int, BlockOutput] = {}
        self.params: dict[int, list[torch.Tensor]] = {}
        # NOTE [context gradients in plain autograd's order]: per context tensor (by id) the
        # first block that takes it, and the gradient the later blocks' backwards summed so far
        self.ctx_first: dict[int, int] = {}
        self.ctx_sums: dict[int, torch.Tensor] = {}
        self.backward_done: set[int] = set()
        self.loss_done = False
        self.rng: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.ran: set[int] = set()
        self.next_block = 0
        self.cursor = 0
        self.alias: weakref.ref[torch.Tensor] | None = None
        self.x_requires_grad = False
        self.device = torch.device("cpu")
        self.autocast: list[tuple[str, bool, torch.dtype]] = []

    @property
    def n(self) -> int:
        """Number of blocks."""
        return len(self.plan.blocks)

    def _now(self) -> float:
        if self.synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def follows(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is the hidden state the previous block returned, or a whole view of it
        (a full backward hook on a block passes its input through an identity Function, which
        hands the forward a view of the same elements)."""
        alias = self.alias() if self.alias is not None else None
        if alias is None:
            return False
        if alias is x:
            return True
        return (
            x._base is alias
            and x.shape == alias.shape
            and x.stride() == alias.stride()
            and x.storage_offset() == alias.storage_offset()
        )

    def _input(self, k: int) -> torch.Tensor:
        return self.plain[k] if k in self.plain else self.outs[k]

    def _drop_x(self, k: int) -> None:
        if k > 0:
            self.plain.pop(k, None)
            self.outs.pop(k, None)

    def _rerun_guard(self, k: int) -> contextlib.AbstractContextManager[None]:
        return rerun_guard(self.plan, self.ran, self.rng, self.device, k)

    def _window(self, kind: str, k: int) -> contextlib.AbstractContextManager[Callable[..., None]]:
        if self.probe is None:
            return contextlib.nullcontext(_ignore)
        return self.probe.forward(kind, k)

    def _offloading(self, k: int, inp: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
        """NOTE [offloaded blocks]: block ``k``'s saved tensors go to the offloader's group
        ``k``, except its input (the run holds it until B(k)), context and parameters."""
        offloader = self.offloader
        if offloader is None or k not in self.plan.offload:
            return contextlib.nullcontext()
        block = self.plan.blocks[k]
        context = [inp, *self.calls[k].tensors(), *block.parameters(), *block.buffers()]
        return offloader.group(k, context)

    def forward_op(self, kind: str, k: int, *, in_forward: bool = False) -> BlockOutput:
        """Run block ``k`` as op ``kind`` (``Fn``, ``Fck`` or ``Fe``); return what it returned.
        ``in_forward``: the model's forward (not a recomputation in the backward)."""
        if self.placer is not None:  # NOTE [placed parameters]
            self.placer.use(k)
            try:
                return self._forward_op(kind, k, in_forward)
            finally:
                if in_forward:
                    self.placer.done(k)
        return self._forward_op(kind, k, in_forward)

    def _forward_op(self, kind: str, k: int, in_forward: bool) -> BlockOutput:
        src, call, fn = self._input(k), self.calls[k], self.plan.forwards[k]
        with self._rerun_guard(k), self._window(kind, k) as seen:
            if kind in ("Fe", "Fs"):
                offloading = self._offloading(k, src) if in_forward else contextlib.nullcontext()
                start = self._now()
                if kind == "Fe":
                    with offloading:
                        out, self.graph[k + 1] = self._with_grad(k, src)
                else:  # NOTE [selective recomputation]
                    keep = Keep()
                    args, kwargs = call.build(src)
                    with torch.no_grad(), keep:
                        out = split_output(k, self.plan.names[k], fn(*args, **kwargs))
                    self.graph[k + 1] = _Graph(src, [], [], keep.results)
                self.fe_s[k] = self._now() - start
                seen(out.hidden)
                last = k + 1 == self.n
                if not (self.loss_done if last else k + 1 in self.backward_done):
                    self.outs[k + 1] = out.hidden  # someone will read x_{k+1}
            else:
                args, kwargs = call.build(src)
                with torch.no_grad():
                    out = split_output(k, self.plan.names[k], fn(*args, **kwargs))
                seen(out.hidden)
                self.plain[k + 1] = out.hidden
                if kind == "Fn" and k > 0:
                    self.plain.pop(k, None)
        return out

    def forward_block(self, k: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Block ``k``'s call in the model's forward: its first op; the values the model gets."""
        if k == 0:
            self.plain[0] = x
            placer = self.placer
            if placer is not None and x.requires_grad and not x.is_leaf:  # NOTE [placed parameters]
                x.register_hook(lambda _: placer.done(0))  # type: ignore[no-untyped-call]
            self.input_nbytes = int(x.untyped_storage().nbytes())
            self.x_requires_grad = x.requires_grad
            self.device = x.device
            self.autocast = _autocast_state(x.device.type)
        for t in self.calls[k].grad_tensors:
            self.ctx_first.setdefault(id(t), k)
        out = self.forward_op(self.plan.first[k], k, in_forward=True)
        self.structure[k] = out.template()
        self.next_block = k + 1
        if k + 1 == self.n:
            self._drop_x(self.n)  # the loss consumes it
            self.loss_done = True
        return tuple(t.detach() for t in (out.hidden, *out.extras))

    def _with_grad(self, k: int, src: torch.Tensor) -> tuple[BlockOutput, _Graph]:
        """Block ``k`` on ``src`` with autograd, from leaves of its own: what B(k) needs."""
        inp = src.detach()
        inp.requires_grad_(k > 0 or self.x_requires_grad)
        ctx = [t.detach().requires_grad_(True) for t in self.calls[k].grad_tensors]
        args, kwargs = self.calls[k].build(inp, ctx)
        with torch.enable_grad():
            out = split_output(k, self.plan.names[k], self.plan.forwards[k](*args, **kwargs))
        roots = [_root(out.hidden), *(_root(e) for e in out.extras)]
        return out, _Graph(inp, ctx, roots)

    def _replay(self, k: int, kept: _Graph) -> _Graph:
        """NOTE [selective recomputation]: Fs(k)'s forward again with autograd, its kept
        results standing in for the expensive ops; a forward that took another path is
        recomputed whole instead (its random state replayed again)."""
        results = kept.kept or []
        with _autocast(self.device.type, self.autocast):
            try:
                with self._rerun_guard(k), Replay(results) as replay:
                    _, graph = self._with_grad(k, kept.inp)
                    replay.finish()
                return graph
            except Diverged:
                results.clear()
        with _autocast(self.device.type, self.autocast), self._rerun_guard(k):
            return self._with_grad(k, kept.inp)[1]

    def backward_block(
        self, k: int, grads: Sequence[torch.Tensor | None]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Function ``k``'s backward: the ops up to ``B(k)``, then ``B(k)``.

        Returns the gradients w.r.t. ``x_k``, the context tensors that require grad, and block
        ``k``'s parameters.
        """
        if self.offloader is not None:  # NOTE [offloaded blocks]: this block's, the next one's
            for group in (k, k - 1):
                if group in self.plan.offload:
                    self.offloader.prefetch(group)
        placer = self.placer
        if placer is not None:  # NOTE [placed parameters]: block k+1's updates are done
            placer.done(k + 1)
        ops = self.plan.backward_ops
        while self.cursor < len(ops) and ops[self.cursor] != ("B", k):
            op = ops[self.cursor]
            if op[0] == "B":
                raise RuntimeError(
                    f"{_PREFIX} autograd reached block {k} while the schedule expected "
                    f"B({op[1]}): the model used the blocks out of order"  # type: ignore[misc]
                )
            with _autocast(self.device.type, self.autocast):  # recomputations only
                self.forward_op(op[0], op[1])  # type: ignore[misc]
            if placer is not None and op[1] != k:  # type: ignore[misc]
                placer.done(op[1])  # type: ignore[misc]
            self.cursor += 1
        self.cursor += 1
        if placer is not None:
            placer.use(k, write=True)
            if k == 0:  # its updates follow this Function: drop it when backward has finished
                torch.autograd.Variable._execution_engine.queue_callback(lambda: placer.done(0))
        return self._backward_op(k, grads)

    def _backward_op(
        self, k: int, grads: Sequence[torch.Tensor | None]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
        g = self.graph.pop(k + 1)
        if g.kept is not None:
            start = self._now()
            g = self._replay(k, g)
            self.replay_s[k] = self._now() - start
        params = self.params[k]
        grad_input = g.inp.requires_grad
        targets = ([g.inp] if grad_input else []) + g.ctx + params
        pairs: list[tuple[_Root, torch.Tensor]] = [
            (r, d) for r, d in zip(g.roots, grads, strict=False) if r is not None and d is not None
        ]
        # NOTE [context gradients in plain autograd's order]
        keys = [id(t) for t in self.calls[k].grad_tensors]
        sums = [self.ctx_sums.pop(key, None) for key in keys]
        if pairs:
            with torch.enable_grad():
                for leaf, s in zip(g.ctx, sums, strict=True):
                    if s is not None:
                        pairs.append((leaf.view_as(leaf), s))
        result: Sequence[torch.Tensor | None] = [None] * len(targets)
        window = self.probe.backward(k) if self.probe else contextlib.nullcontext(_ignore)
        with window as seen:
            start = self._now()
            if pairs and targets:
                roots = [r for r, _ in pairs]
                outs = [d for _, d in pairs]
                del pairs
                result = torch.autograd.grad(roots, targets, outs, allow_unused=True)  # type: ignore[arg-type]
                del roots, outs
            self.b_s[k] = self._now() - start
            d_k = result[0] if grad_input else None
            param_grads = list(result[len(targets) - len(params) :])
            seen(d_k, [p for p in param_grads if p is not None])
        ctx_grads = list(result[int(grad_input) : len(targets) - len(params)])
        for i, key in enumerate(keys):
            grad = ctx_grads[i] if ctx_grads[i] is not None else sums[i]
            ctx_grads[i] = grad
            if grad is not None and self.ctx_first.get(key, k) < k:
                self.ctx_sums[key] = grad  # returned by the first block that takes the tensor
                ctx_grads[i] = None
        del g
        self.backward_done.add(k)
        self._drop_x(k)
        self.calls.pop(k, None)  # no block is recomputed after its backward
        if k == 0:
            self.plain.clear()
            self.outs.clear()
            self.ctx_sums.clear()
            if self.on_done is not None:
                self.on_done(self)
        return (d_k if k > 0 or self.x_requires_grad else None), ctx_grads, param_grads


def _ignore(*_: object) -> None:
    """The ``seen`` callback when nothing measures."""


class BlockFunction(torch.autograd.Function):
    """Block ``k``'s call: ``apply(run, k, x_k, *context_grad_tensors, *params_k)``."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        run: BlockRun = args[0]
        k: int = args[1]
        ctx.run, ctx.k = run, k
        ctx.n_ctx = len(run.calls[k].grad_tensors)
        ctx.set_materialize_grads(False)
        outs = run.forward_block(k, args[2])
        ctx.mark_non_differentiable(
            *(t for t in outs if not (t.is_floating_point() or t.is_complex()))
        )
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Any) -> Any:
        run: BlockRun | None = ctx.run
        if run is None:
            raise InvalidArgumentError(
                f"{_PREFIX} a second backward reached a checkpointed block (block {ctx.k}, "
                f"retain_graph=True and another backward through the same forward): its "
                f"activations were freed by the first backward. Add the losses and call "
                f"backward once ((loss + aux).backward(): the same gradients), or run the "
                f"forward again for the second backward"
            )
        ctx.run = None
        d_k, ctx_grads, param_grads = run.backward_block(ctx.k, grads)
        return (None, None, d_k, *ctx_grads, *param_grads)
