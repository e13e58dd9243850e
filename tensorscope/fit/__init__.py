"""``ts.fit(model, optimizer, budget=...)``: fit a training step into a byte budget (docs/api.md
§10, docs/fit.md).

The decision is pure (account.py: the recorded step outside the block chain; decide.py: one
plan under one budget; report.py: ``explain()``); the handle (handle.py) applies it through the
block chain's checkpointing (``tensorscope.checkpoint``) and the optimizer's update inside
backward (inbackward.py). ``tensorscope.fit.offload`` offloads the tensors autograd saves for
backward, per block (``offload_blocks``; not yet a choice ``ts.fit`` makes: docs/fit.md). This
module stays small: the handle is imported at the first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer

    from tensorscope.fit.handle import Fit

__all__ = ["Fit", "fit"]


def fit(
    model: nn.Module,
    optimizer: Optimizer,
    budget: int | str,
    *,
    blocks: str | None = None,
    atomic: bool = False,
    compile: bool = False,
) -> Fit:
    """Fit ``model``'s training step with ``optimizer`` into ``budget`` bytes; nothing runs yet.

    The user's loop stays as it is (in ``ts.scope()`` or not). The first training step (the
    model's first forward in ``train()`` mode, up to ``optimizer.step()``) is recorded
    (``fit.plan_before``) and runs conservatively: the block chain checkpointed at every block
    while it is measured, gradients kept. At its end one decision is taken under the budget,
    by predicted step time: rotor's schedule for the chain (which blocks keep their activations,
    which are recomputed) and, where the recorded step has no op that reads all gradients
    (``clip_grad_norm_``, a GradScaler's ``unscale_``, gradient accumulation), each parameter's
    update applied inside backward with its gradient freed at once. Results equal the plain
    loop's (bit-identical on CPU for deterministic ops).

    Args:
        model: the model (its block chain, the longest ``nn.ModuleList`` of blocks of one class,
            is found automatically; none: only gradients are planned).
        optimizer: its ``torch.optim.Optimizer`` (accelerate's wrapper is unwrapped).
        budget: bytes (``int``) or a string such as ``"3GiB"``: everything the step holds on
            the device -- parameters, gradients, optimizer state, activations, temporaries --
            as the memory plan counts it (storage bytes).
        blocks: dotted path of the block list to use instead of finding it.
        atomic: keep every step atomic: an exception out of a step's forward, backward or
            ``optimizer.step()`` then leaves parameters and optimizer state as they were
            (gradients are kept until ``optimizer.step()``, which runs whole; ``explain()``
            states the cost). Without it an aborted step may leave parameters already updated
            inside backward, and a ``FitWarning`` names them (docs/fit.md, aborted steps).
        compile: compile what the fit runs with ``torch.compile``: each block's forward inside
            the chain (a recomputed block reruns its compiled forward) and the model's forward
            around it (or the user's own compile of the model, either order); the measuring
            step runs eagerly, the blocks are re-timed compiled. Results are allclose to the
            plain loop's, not bit-identical; ``explain()`` says so (docs/fit.md).

    Returns:
        a :class:`~tensorscope.fit.handle.Fit`: ``explain()``, ``plan_before``,
        ``plan_after``, ``remove()``.

    Raises:
        ArgumentTypeError: not a module, not an optimizer, a budget of the wrong type.
        ArgumentTypeError: (also) ``atomic`` or ``compile`` not a bool.
        InvalidArgumentError: an unparsable budget, HF gradient checkpointing already on, or
            the model or the optimizer already fitted.
        ScheduleError: (from ``optimizer.step()`` of the first step, then at every training
            forward) no plan fits the budget; the message names the smallest that does.

    Example:
        >>> import torch, tensorscope as ts
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> fitted = ts.fit(model, opt, budget="4MiB")
        >>> for _ in range(3):
        ...     model(torch.randn(32, 64)).square().mean().backward()
        ...     opt.step(); opt.zero_grad()
        >>> fitted.decision.free_gradients
        True
        >>> fitted.plan_after.peak_bytes <= fitted.budget_bytes
        True
        >>> fitted.remove()
    """
    from tensorscope.fit.make import make_fit

    return make_fit(model, optimizer, budget, blocks=blocks, atomic=atomic, compiled=compile)


def __getattr__(name: str) -> Any:
    if name == "Fit":
        from tensorscope.fit.handle import Fit

        return Fit
    raise AttributeError(f"module 'tensorscope.fit' has no attribute {name!r}")
