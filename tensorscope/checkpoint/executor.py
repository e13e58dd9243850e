"""Run a checkpointing schedule inside autograd: forward ops in forward, the rest in backward.

One custom ``torch.autograd.Function`` per model call: its forward runs the ops before
``Loss`` and returns the chain output; its backward receives the output gradient and runs
the ops after ``Loss`` (recomputations and layer backwards).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Collection, Iterator, Sequence
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.autograd.graph import GradientEdge, get_gradient_edge

from tensorscope.checkpoint.chain import Op, forward_runs
from tensorscope.errors import InvalidArgumentError

__all__ = ["Executor"]

# NOTE [executing a schedule]
# * Parameters are inputs of the Function and their gradients are returned from its backward,
#   so gradients reach parameters when the input does not require grad, and
#   torch.autograd.grad(loss, params) works (the reentrant torch.utils.checkpoint's pitfalls).
#   Each B(k) is one torch.autograd.grad(y_k, [x_k, *params_k], d_{k+1}) on the small graph
#   Fe(k) built: the input gradient flows on, parameter gradients are summed per parameter.
# * Fe(k) detaches its input into a fresh leaf, so B(k) stops at layer k, and keeps the output's
#   GradientEdge rather than the output: B(k) differentiates the edge, so the output tensor can
#   die as soon as nobody reads it (NOTE [memory model] in simulate.py). The chain output is
#   returned detached: the Function's node, not the inner graph, is its grad_fn.
# * NOTE [merged backward]: one engine call per layer costs ~0.1 ms each. When B(k-1) directly
#   follows B(k) and x_k is Fe(k-1)'s output, Fe(k) reads it without detaching, so layers
#   k-1 and k form one graph and one torch.autograd.grad runs both backwards (the engine frees
#   saved tensors and gradients node by node, as separate calls would). The incoming gradient
#   is handed to the root node by a pre-hook instead of held in grad_outputs, so it dies
#   inside the call exactly when B(k) would have freed it.
# * Random state: the first run of a layer that the schedule runs again saves the CPU (and
#   CUDA) RNG state (only for `rng_layers`: the profiler tells which layers draw numbers);
#   each re-run restores it and then puts the surrounding state back, so dropout draws the
#   same mask and the global RNG stream is the plain model's. The first runs
#   happen in order during the forward (before Loss every layer runs exactly once), so masks
#   are the plain model's too.
# * BatchNorm: a re-run must not update running statistics a second time. In training mode
#   with track_running_stats=False, _BatchNorm.forward normalises with batch statistics (the
#   same output and backward) and touches no buffer, so re-runs temporarily clear that flag.
# * Re-runs during backward happen outside the caller's autocast context: the forward's
#   autocast state is captured and re-entered, as torch.utils.checkpoint does.


class _Plan:
    """What does not change between calls: the layers, the ops, who is recomputed."""

    def __init__(
        self, layers: Sequence[nn.Module], ops: Sequence[Op], rng_layers: Collection[int]
    ) -> None:
        self.layers = list(layers)
        split = list(ops).index(("Loss",))
        self.forward_ops = list(ops[:split])
        self.backward_ops = list(ops[split + 1 :])
        self.rerun = {k for k, n in forward_runs(ops).items() if n > 1}
        self.replay_rng = self.rerun.intersection(rng_layers)
        # B(k) directly followed by B(k-1): layer k may be chained onto layer k-1's graph
        self.adjacent = {
            a[1]  # type: ignore[misc]
            for a, b in itertools.pairwise(self.backward_ops)
            if a[0] == b[0] == "B" and b[1] == a[1] - 1  # type: ignore[misc]
        }
        self.batchnorms = [
            [m for m in layer.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
            for layer in self.layers
        ]


class _Run:
    """State of one call: alive activations, autograd pieces, RNG states, gradients."""

    def __init__(self, plan: _Plan, x: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        self.plan = plan
        self.plain: dict[int, torch.Tensor] = {0: x}  # x_k from Fn/Fck, and the input
        self.outs: dict[int, torch.Tensor] = {}  # x_k as the output of Fe(k-1)
        self.graph: dict[int, tuple[torch.Tensor, _Root]] = {}  # k+1: (input, output root)
        self.chained: set[int] = set()  # layers whose Fe read Fe(k-1)'s output undetached
        self.merged: set[int] = set()  # layers whose backward already ran in a merged call
        self.backward_done: set[int] = set()
        self.loss_done = False
        self.rng: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.ran: set[int] = set()
        self.x_requires_grad = x.requires_grad
        self.device = x.device
        index = {id(p): i for i, p in enumerate(params)}
        self.layer_params = [
            sorted({index[id(p)] for p in layer.parameters() if id(p) in index})
            for layer in plan.layers
        ]
        self.params = list(params)
        self.param_grads: list[torch.Tensor | None] = [None] * len(params)
        self.grad: torch.Tensor | None = None
        self.autocast = _autocast_state(x.device.type)

    def _input(self, k: int) -> torch.Tensor:
        if k in self.plain:
            return self.plain[k]
        return self.outs[k]

    def _drop_x(self, k: int) -> None:
        """Drop our references to x_k (autograd keeps what it saved; NOTE [memory model])."""
        if k > 0:
            self.plain.pop(k, None)
            self.outs.pop(k, None)

    def _rerun_guard(self, k: int) -> contextlib.AbstractContextManager[None]:
        return rerun_guard(self.plan, self.ran, self.rng, self.device, k)

    def forward_op(self, kind: str, k: int) -> None:
        layer = self.plan.layers[k]
        src = self._input(k)
        with self._rerun_guard(k):
            if kind == "Fe":
                if k in self.plan.adjacent and k in self.outs and src.requires_grad:
                    inp = src  # NOTE [merged backward]
                    self.chained.add(k)
                else:
                    inp = src.detach()
                    if k > 0 or self.x_requires_grad:
                        inp.requires_grad_(inp.is_floating_point() or inp.is_complex())
                with torch.enable_grad():
                    out = layer(inp)
                self.graph[k + 1] = (inp, _root(out))
                last = k + 1 == len(self.plan.layers)
                if not (self.loss_done if last else k + 1 in self.backward_done):
                    self.outs[k + 1] = out  # someone will read x_{k+1}
            else:
                with torch.no_grad():
                    self.plain[k + 1] = layer(src)
                if kind == "Fn" and k > 0:
                    self.plain.pop(k, None)

    def backward_op(self, k: int) -> None:
        if k in self.merged:  # its backward already ran with B(k+1)'s
            self.backward_done.add(k)
            self._drop_x(k)
            return
        bottom = k
        while bottom in self.chained:
            bottom -= 1
        inp, root = self.graph.pop(bottom + 1)
        if k > bottom:
            root = self.graph.pop(k + 1)[1]
        for j in range(bottom + 1, k + 1):
            self.graph.pop(j + 1, None)
            self._drop_x(j)  # the graph keeps what the backward needs (NOTE [memory model])
        owned = sorted({i for j in range(bottom, k + 1) for i in self.layer_params[j]})
        grad_input = inp.requires_grad
        targets = ([inp] if grad_input else []) + [self.params[i] for i in owned]
        if self.grad is not None and root is not None and targets:
            incoming, self.grad = [self.grad], None  # a list, not a local: see _grad
            grads = _grad(root, targets, incoming)
            del root
            if grad_input:
                self.grad, grads = grads[0], grads[1:]
            for i, g in zip(owned, grads, strict=True):
                if g is not None:
                    acc = self.param_grads[i]
                    self.param_grads[i] = g if acc is None else acc + g
        else:
            self.grad = None
        self.merged.update(range(bottom, k))
        self.backward_done.add(k)
        self._drop_x(k)

    def forward_phase(self) -> torch.Tensor:
        for op in self.plan.forward_ops:
            self.forward_op(op[0], op[1])  # type: ignore[misc]
        n = len(self.plan.layers)
        out = self._input(n).detach()
        self._drop_x(n)  # the loss consumes it
        self.loss_done = True
        return out

    def backward_phase(self, grad_out: torch.Tensor) -> None:
        self.grad = grad_out
        with _autocast(self.device.type, self.autocast):
            for op in self.plan.backward_ops:
                if op[0] == "B":
                    self.backward_op(op[1])  # type: ignore[misc]
                else:
                    self.forward_op(op[0], op[1])  # type: ignore[misc]


_Root: TypeAlias = torch.Tensor | GradientEdge | None


def _root(out: torch.Tensor) -> _Root:
    """What B(k) differentiates: the output's gradient edge, so the output itself can be freed
    while its graph lives (a leaf output, e.g. nn.Identity's, is its own root)."""
    if not out.requires_grad:
        return None
    return out if out.grad_fn is None else get_gradient_edge(out)


def _grad(
    root: torch.Tensor | GradientEdge,
    targets: list[torch.Tensor],
    holder: list[torch.Tensor],
) -> tuple[torch.Tensor | None, ...]:
    """torch.autograd.grad(root, targets, holder[0]) without holding that gradient during the
    call: the engine gets it from a pre-hook on the root node and frees it once consumed. (An
    argument would stay referenced by the caller's frame until the call returns; the list
    lets the tensor go.)"""
    if isinstance(root, torch.Tensor):
        return torch.autograd.grad(root, targets, holder.pop(), allow_unused=True)
    nr = root.output_nr

    def hand_over(grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        out = list(grads)
        out[nr] = holder.pop()
        return tuple(out)

    g = holder[0]
    placeholder = torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
    del g
    handle = root.node.register_prehook(hand_over)
    try:
        return torch.autograd.grad(root, targets, placeholder, allow_unused=True)
    finally:
        handle.remove()


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    types = ["cpu"] if device_type == "cpu" else [device_type, "cpu"]
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


@contextlib.contextmanager
def _autocast(device_type: str, state: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for dev, enabled, dtype in state:
            if enabled:
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=True))
        yield


class _ScheduleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        plan: _Plan = args[0]
        x: torch.Tensor = args[1]
        run = _Run(plan, x, args[2:])
        ctx.run = run
        ctx.x_requires_grad = x.requires_grad
        return run.forward_phase()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        run: _Run | None = ctx.run
        if run is None:
            raise InvalidArgumentError(
                "tensorscope.checkpoint: a second backward reached a Checkpointable call "
                "(retain_graph=True and another backward through the same forward): its "
                "activations were freed by the first backward. Add the losses and call "
                "backward once, or run the forward again (or use the plain model)"
            )
        ctx.run = None
        run.backward_phase(grad_outputs[0])
        d0 = run.grad if ctx.x_requires_grad else None
        return (None, d0, *run.param_grads)


class Executor:
    """Runs ``layers`` following a schedule; reusable across calls (one plan, fresh state).

    ``ops`` must be a complete schedule for ``len(layers)`` layers (see
    :func:`tensorscope.checkpoint.simulate`). The gradients w.r.t. the input (if it requires
    grad) and w.r.t. every parameter that requires grad are those of the plain model.

    Example:
        >>> import torch
        >>> layers = [torch.nn.Linear(4, 4), torch.nn.Tanh()]
        >>> ops = [("Fck", 0), ("Fe", 1), ("Loss",), ("B", 1), ("Fe", 0), ("B", 0)]
        >>> Executor(layers, ops)(torch.randn(2, 4)).sum().backward()
        >>> layers[0].weight.grad.shape
        torch.Size([4, 4])
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        ops: Sequence[Op],
        *,
        preserve_rng_state: bool = True,
        rng_layers: Collection[int] | None = None,
    ) -> None:
        if not preserve_rng_state:
            rng_layers = ()
        elif rng_layers is None:
            rng_layers = range(len(layers))
        self.plan = _Plan(layers, ops, rng_layers)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        for layer in self.plan.layers:
            for p in layer.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        out: torch.Tensor = _ScheduleFunction.apply(self.plan, x, *params)  # type: ignore[no-untyped-call]
        return out


@contextlib.contextmanager
def rerun_guard(
    plan: Any, ran: set[int], rng: dict[int, Any], device: torch.device, k: int
) -> Iterator[None]:
    """Block ``k``'s forward: the first run saves its RNG state (where it draws random
    numbers); a rerun replays that state and leaves BatchNorm running statistics alone, then
    restores the RNG state it found. Shared by the Sequential executor and block chains."""
    first = k not in ran
    ran.add(k)
    if first:
        if k in plan.replay_rng:
            cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            rng[k] = (torch.get_rng_state(), cuda)
        yield
        return
    saved_cpu = torch.get_rng_state()
    saved_cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    tracked = [bn for bn in plan.batchnorms[k] if bn.training and bn.track_running_stats]
    try:
        if k in rng:
            cpu, cuda = rng[k]
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, device)
        for bn in tracked:
            bn.track_running_stats = False
        yield
    finally:
        for bn in tracked:
            bn.track_running_stats = True
        torch.set_rng_state(saved_cpu)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda, device)
