"""The compile part: ``ts.fit(..., compile=True)`` compiles what the fit runs -- each block's
own forward inside the chain, and the model's forward around it.

# NOTE [compile=True]
# What is compiled. Each block's own forward, where the chain runs it (checkpoint/routes.py
# ``wrap``): kept, recomputed in the backward, offloaded or run plainly, the chain calls the
# compiled forward, so a recomputation reruns the compiled code (torchtitan compiles each
# block after wrapping it for activation checkpointing; here the wrapping is the chain's,
# around the compiled forward). The chain's dispatch is compiler-disabled (NOTE [compiled
# models and the chain]), so the model's forward is compiled too (an instance attribute, as
# the chain's routing does it): its graph breaks around each block's call, the embedding
# before the chain and the head and loss after it are compiled. A model its user compiled
# (torch.compile(model) or model.compile(), either order) keeps the user's compile around
# the chain: only the blocks are compiled by the fit, and a forward of ours reached while the
# user's compile traces the model runs as it is, traced by that compile.
#
# One code object, one cache. Blocks of one class share their forward's code object, and
# Dynamo's recompile limit (8) counts entries per code object. With inline_inbuilt_nn_modules
# (on by default in torch 2.13) a module's parameters and buffers are the graph's inputs,
# not guarded constants, so every block of a class runs one graph per grad mode (a kept
# block's forward runs with grad, a checkpointed one's without): 2 entries for any number of
# blocks (tests/fit/test_fit_compile_option.py runs 4 blocks under a limit of 2). A new
# sequence length recompiles once, with a dynamic length (Dynamo's automatic dynamic shapes);
# a larger batch than the measured one is measured and decided again (phase.py).
#
# Which steps run compiled. The measuring step (step 1, recorded) runs eagerly: the recording
# must see every op to count the step's memory (a compiled graph is one op to it, the
# temporaries inside unseen), and its wall time must not hold the compile. Its memory is the eager
# step's, expected to be at least the compiled one's (inductor's partitioner saves a min-cut
# of the forward for backward and fuses temporaries away; not measured op by op). The steps
# after the decision run compiled: the first ones compile (each graph once); the chain re-times its
# blocks in the first run that compiled nothing (NOTE [retiming compiled blocks],
# checkpoint/blocks.py), so the decision's block times are compiled times; the step after
# that is recorded (plan_after, the budget checked against it); the two after are timed and
# the rest of the step (outside the chain, recorded eagerly) is scaled to what the compiled
# steps measured (NOTE [a prediction measured against], handle.py): at most one re-decision.
# Results are allclose to the plain loop's, not its bits (inductor fuses and reorders).
#
# Random numbers. Inductor's own generator draws dropout's masks differently from eager's, and
# differently in a block's no-grad graph (checkpointed) than in its grad graph (recomputed):
# the recomputation would not see the forward's mask, and the gradients would be wrong. So
# inductor compiles with ``fallback_random``: random ops call eager's kernels, the chain's saved
# random states replay them (NOTE [a Function per block]), and the masks are the plain loop's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tensorscope._copies import MISSING, Attached, leave_out_of_copies
from tensorscope.checkpoint.blocks import CheckpointedChain
from tensorscope.fit.parts import Part, Step

__all__ = ["BACKEND", "CompiledRun", "graphs_compiled"]

#: The backend fit compiles with (tests set "aot_eager" or a counting callable).
BACKEND: Any = "inductor"


def _counters() -> Any:
    from torch._dynamo.utils import counters

    return counters


def graphs_compiled() -> int:
    """Graphs Dynamo compiled in this process so far."""
    return int(_counters()["stats"]["unique_graphs"])


def _breaks() -> Counter[str]:
    return Counter(_counters()["graph_break"])


class _Compiled:
    """``fn`` compiled, run as it is while ``part.eager`` (a measuring step) or while another
    compile traces it (NOTE [compile=True])."""

    def __init__(self, fn: Callable[..., Any], part: CompiledRun, block: bool) -> None:
        self.fn = fn
        options: dict[str, Any] | None = (
            {"fallback_random": True} if BACKEND == "inductor" else None
        )
        self.compiled: Callable[..., Any] = torch.compile(fn, backend=BACKEND, options=options)
        self.part = part
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        part = self.part
        if part.eager or torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
        if not self.block or part.settled:
            return self.compiled(*args, **kwargs)
        graphs, breaks = graphs_compiled(), _breaks()
        try:
            return self.compiled(*args, **kwargs)
        finally:  # while the blocks compile: what broke their graphs
            part.block_graphs += graphs_compiled() - graphs
            part.block_breaks.update(_breaks() - breaks)


class CompiledRun(Part):
    """Compiles the blocks' forwards and the model's forward from attach to detach (NOTE
    [compile=True]); off when ``enabled`` is False.

    Attributes:
        eager: the step in progress runs eagerly (a measuring step).
        warming: the last step compiled a graph (the fit records a step only after one that
            compiled nothing).
        user_compiled: the model was compiled by its user (its compile covers the forward).
        block_graphs: graphs compiled for the blocks' forwards so far.
        block_breaks: graph breaks found while compiling them, by reason.
    """

    def __init__(self, chain: CheckpointedChain | None, enabled: bool) -> None:
        self.chain = chain
        self.enabled = enabled
        self.eager = True
        self.warming = False
        self.settled = False  # a step under a decision compiled nothing: breaks are known
        self.user_compiled = False
        self.block_graphs = 0
        self.block_breaks: Counter[str] = Counter()
        self._at_start = 0
        self._model: nn.Module | None = None
        self._kept_out: Attached | None = None
        self._previous: object = MISSING

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not self.enabled:
            return
        self.user_compiled = _user_compiled(model)
        if self.chain is not None:
            self.chain.wrap_forwards(lambda k, fn: _Compiled(fn, self, block=True))
            self.chain.compiles = graphs_compiled
            # NOTE [selective recomputation]: Inductor's partitioner keeps a min-cut inside
            # the graph; a dispatch mode around a compiled forward would run it eagerly
            self.chain.selective = False
        if not self.user_compiled:
            self._model = model
            self._previous = model.__dict__.get("forward", MISSING)
            model.forward = _Compiled(model.forward, self, block=False)
            self._kept_out = leave_out_of_copies(model, attrs={"forward": self._previous})

    def detach(self) -> None:
        if self.chain is not None and self.enabled:
            self.chain.wrap_forwards(None)
            self.chain.compiles = None
            self.chain.selective = True
        model, self._model = self._model, None
        if model is None:
            return
        if self._kept_out is not None:
            self._kept_out.remove()
            self._kept_out = None
        if self._previous is MISSING:
            model.__dict__.pop("forward", None)
        else:
            model.__dict__["forward"] = self._previous
        self._previous = MISSING

    def step_start(self, step: Step) -> None:
        self.eager = step.measured
        self._at_start = graphs_compiled() if self.enabled else 0

    def step_end(self, step: Step | None) -> None:
        if step is not None and self.enabled:
            self.warming = graphs_compiled() != self._at_start
            self.settled = self.settled or not (step.measured or self.warming)

    def abort(self, step: Step) -> list[torch.Tensor]:
        self.warming = True  # what it compiled is not known to be all
        return []

    def lines(self) -> list[str]:
        """What ``explain()`` says about compiling (nothing when compile=True is not used)."""
        if not self.enabled:
            return []
        backend = BACKEND if isinstance(BACKEND, str) else type(BACKEND).__name__
        around = (
            "the model's forward around the chain: compiled by its user (torch.compile)"
            if self.user_compiled
            else "the model's forward around the chain compiled too (its graph breaks at "
            "each block's call)"
        )
        out = [
            f"compile=True (torch.compile, backend {backend}): "
            + (
                "each block's forward compiled inside the chain (a recomputed block reruns "
                "its compiled forward); "
                if self.chain is not None
                else ""
            )
            + around,
            (
                "step 1 ran the blocks eagerly (recorded; the user's compile compiled in it)"
                if self.user_compiled
                else "step 1 ran eagerly (recorded)"
            )
            + ("; the chain's blocks re-timed compiled" if self.chain is not None else "")
            + "; results allclose to the plain loop's, not bit-identical (compiled kernels "
            "fuse and reorder)",
        ]
        if self.block_breaks:
            n = sum(self.block_breaks.values())
            reasons = "; ".join(
                sorted({(r.splitlines() or [""])[0][:100] for r in self.block_breaks})[:3]
            )
            out.append(
                f"a block's forward does not compile whole: {n} graph break(s) ({reasons}); "
                f"the pieces between them run compiled, the rest eagerly; the plan is as "
                f"decided"
            )
        return out


def _user_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is compiled by its user: ``torch.compile(model)``'s wrapper, or
    ``model.compile()`` (its compiled call)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return (
        isinstance(model, OptimizedModule)
        or getattr(model, "_compiled_call_impl", None) is not None
    )
