"""The large-vocabulary loss with one buffer of logits' size less in its backward, bit-identical
to ``F.cross_entropy``. See NOTE [the loss's gradient in place].
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

from tensorscope._modes import FunctionMode
from tensorscope.errors import InvalidArgumentError

__all__ = ["MIN_LOSS_BYTES", "LossMode", "in_place_cross_entropy"]

# NOTE [the loss's gradient in place]
# F.cross_entropy(logits, target) on class indices is log_softmax then nll_loss (ATen's
# cross_entropy_loss). Autograd saves the log-probabilities (N x V), and its backward holds them,
# nll_loss's gradient (N x V, zero but at the targets) and log_softmax's gradient (N x V) at once:
# three buffers of the logits' size, the step's peak for a large vocabulary. Here the same
# kernels run (log_softmax, nll_loss_forward; in backward nll_loss_backward and
# _log_softmax_backward_data, with the whole batch's total weight) on a block of rows at a time,
# and each block's gradient is written over its own log-probabilities, which it no longer
# needs: one buffer of the logits' size plus a block's two. Each of these kernels computes a
# row from that row alone, so the values are the same bits as the plain loss's. The saved
# log-probabilities are overwritten: a second backward through the same graph
# (retain_graph=True) raises autograd's "modified by an inplace operation" error, and a
# gradient of the gradient (create_graph=True) an InvalidArgumentError: the gradient is computed
# from saved tensors outside autograd's view, and would silently be a constant.
# LossMode (a TorchFunctionMode, thread-local) routes F.cross_entropy calls of the model's
# training forward here when the call is the plain form (2-D logits that require grad, 1-D
# class indices, no class weights, no label smoothing, mean or sum) and the logits are at
# least MIN_LOSS_BYTES; anything else runs as it was. Under autocast, ATen casts the logits to
# float32 for cross_entropy; here the same differentiable cast runs first, then the loss with
# autocast off (log_softmax alone is not on CPU autocast's float32 list: it would run in bf16).

MIN_LOSS_BYTES = 1 << 20
_ROWS_BYTES = 4 << 20  # a block of rows: about this many bytes of logits
_REDUCTIONS = {"mean": 1, "sum": 2}


class _InPlaceCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int
    ) -> torch.Tensor:
        logp = torch.log_softmax(logits, 1)
        loss, total_weight = torch.ops.aten.nll_loss_forward(
            logp, target, None, reduction, ignore_index
        )
        ctx.save_for_backward(logp, target, total_weight)
        ctx.reduction, ctx.ignore_index = reduction, ignore_index
        return loss  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: this gradient would be a constant
            raise InvalidArgumentError(
                "tensorscope.fit: the loss's backward runs in place (one buffer of the logits' "
                "size less) and cannot be differentiated again (create_graph=True); compute "
                "that loss outside the model's forward, or without ts.fit"
            )
        logp, target, total_weight = ctx.saved_tensors
        n, v = logp.shape
        rows = max(1, _ROWS_BYTES // max(1, v * logp.element_size()))
        for first in range(0, n, rows):
            block = logp[first : first + rows]
            g = torch.ops.aten.nll_loss_backward(
                grad,
                block,
                target[first : first + rows],
                None,
                ctx.reduction,
                ctx.ignore_index,
                total_weight,
            )
            block.copy_(torch.ops.aten._log_softmax_backward_data(g, block, 1, block.dtype))
            del g
        return logp, None, None, None


def in_place_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean", ignore_index: int = -100
) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ...)``, the same bits, with its backward's gradient
    written over the saved log-probabilities (NOTE [the loss's gradient in place]).

    Example:
        >>> x = torch.randn(6, 50, requires_grad=True)
        >>> t = torch.tensor([1, 2, -100, 4, 5, 49])
        >>> a = in_place_cross_entropy(x, t)
        >>> b = functional.cross_entropy(x, t)
        >>> ga, = torch.autograd.grad(a, x); gb, = torch.autograd.grad(b, x)
        >>> torch.equal(a, b), torch.equal(ga, gb)
        (True, True)
    """
    device = logits.device.type
    if not torch.is_autocast_enabled(device):
        loss: torch.Tensor = _InPlaceCrossEntropy.apply(  # type: ignore[no-untyped-call]
            logits, target, _REDUCTIONS[reduction], ignore_index
        )
        return loss
    # autocast runs cross_entropy in float32: the same cast, then the loss outside autocast
    with torch.autocast(device, enabled=False):
        return in_place_cross_entropy(logits.float(), target, reduction, ignore_index)


def _plain_form(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
    bound = dict(zip(names, args, strict=False)) | kwargs
    logits, target = bound.get("input"), bound.get("target")
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if (
        bound.get("weight") is not None
        or bound.get("size_average") is not None
        or bound.get("reduce") is not None
        or bound.get("label_smoothing", 0.0) != 0.0
        or bound.get("reduction", "mean") not in _REDUCTIONS
        or logits.dim() != 2
        or target.dim() != 1
        or target.dtype != torch.long
        or not logits.is_floating_point()
        or not logits.requires_grad
        or not torch.is_grad_enabled()
        or logits.nbytes < MIN_LOSS_BYTES
        or type(logits) not in (torch.Tensor, torch.nn.Parameter)  # no subclass (DTensor...)
    ):
        return None
    return logits, target, bound.get("reduction", "mean"), int(bound.get("ignore_index", -100))


class LossMode(FunctionMode):
    """Routes a large plain ``F.cross_entropy`` to :func:`in_place_cross_entropy` (see the
    NOTE); counts the calls routed in ``routed`` and the last logits' shape in ``shape``."""

    def __init__(self) -> None:
        super().__init__()
        self.routed = 0
        self.shape: tuple[int, ...] = ()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is functional.cross_entropy:
            plain = _plain_form(args, kwargs)
            if plain is not None:
                self.routed += 1
                self.shape = tuple(plain[0].shape)
                return in_place_cross_entropy(*plain)
        return func(*args, **kwargs)
