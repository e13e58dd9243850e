"""The LM head and its cross-entropy in row chunks, forward and backward: the logits and their
gradient never exist whole (Liger-Kernel's fused linear cross-entropy, in plain PyTorch). See
NOTE [the head and its loss in row chunks].

Pure torch: no tensorscope state. ``causal_lm.py`` routes an HF causal LM's loss here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.nn import functional

from tensorscope.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["CHUNK_BYTES", "MIN_CHUNKS", "chunk_rows", "chunk_rows_for", "linear_cross_entropy"]

# NOTE [the head and its loss in row chunks]
# A plain LM loss, F.cross_entropy(F.linear(h, W, b).float(), y), holds the logits (N x V) and,
# in backward, up to three buffers of their size: with a 32000-word vocabulary and 1024 tokens
# that is 125 MiB each, more than a small model's weights. Here the rows of h go through in
# chunks; for each chunk the logits are computed (matmul in h's dtype, as the lm_head; then
# upcast to float32 as HF's loss does), the chunk's loss is summed, and at once the chunk's
# gradient with respect to its logits -- softmax(z) - (1 - eps) onehot(y) - eps / V, times the
# row's weight (1 / the number of rows not ignored for "mean", 1 for "sum", 0 for ignored
# rows) -- is cast to h's dtype and multiplied into grad_hidden's rows (g @ W) and added into
# grad_weight (g^T h, accumulated in float32) and grad_bias. So the forward holds one chunk's
# logits and the two gradients; the backward only scales them by the incoming gradient
# (in place: a second backward through the same graph, retain_graph=True, raises autograd's
# "modified by an inplace operation" error; create_graph=True an InvalidArgumentError, as
# that gradient would be a constant). Peak extra memory: grad_hidden (N x H, h's dtype),
# grad_weight (V x H, float32) and one chunk: its logits in h's dtype and in float32 (the same
# buffer for float32), the gradient cast back to h's dtype, a V x H product of h's dtype when
# that is not float32, and with a softcap one more float32 chunk -- never N x V.
# The price: the sums over rows (the loss, W's and b's gradients) are taken in another order,
# so results are allclose to the plain loss's (float32: rtol 1e-5), not its bits; the
# bit-identical alternative keeps the logits (loss.py). Under autocast, h, W and b are cast to
# the autocast dtype first (what autocast's linear does), and the chunks run with autocast off.
# Float64 inputs stay float64 (HF's .float() would round them to float32). A softcap
# (Gemma 2's final_logit_softcapping: cap * tanh(z / cap)) is applied in float32 after the
# upcast (HF applies it in the model's dtype before it; the same for float32 models).
# Targets out of range raise on CPU tensors; on an accelerator checking them would wait for
# the device at every call, so a bad target there is the device-side assertion that
# F.cross_entropy gives.

CHUNK_BYTES = 32 << 20  # a chunk's float32 logits: about this many bytes (see chunk_rows_for)


def chunk_rows_for(vocab: int, nbytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that a chunk's float32 logits take about ``nbytes`` (at least 1 row).

    32 MiB: 262 rows of a 32000-word vocabulary, 163 of a 50257-word one, 63 of a 128256-word
    one -- large enough that each chunk's matmuls keep an accelerator busy, small beside the
    N x V logits this avoids (a few chunks' worth is held at once, see the NOTE).

    Example:
        >>> chunk_rows_for(32000), chunk_rows_for(10, nbytes=4), chunk_rows_for(10**9)
        (262, 1, 1)
    """
    return max(1, nbytes // (4 * max(1, vocab)))


MIN_CHUNKS = 4  # a loss of few rows still runs in this many chunks: never the whole logits


def chunk_rows(rows: int, vocab: int, nbytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk for ``rows`` rows: :func:`chunk_rows_for`, and at most a
    ``MIN_CHUNKS``-th of the rows (so a small batch's logits are not made whole either).

    Example:
        >>> chunk_rows(100_000, 32000), chunk_rows(256, 4096), chunk_rows(3, 4096)
        (262, 64, 1)
    """
    return max(1, min(chunk_rows_for(vocab, nbytes), -(-rows // MIN_CHUNKS)))


class _Options(NamedTuple):
    ignore_index: int
    summed: bool  # reduction "sum" (else "mean")
    smoothing: float
    rows: int
    softcap: float | None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_rows: int | None = None,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)``, allclose,
    computed ``chunk_rows`` rows at a time with its gradients, never holding the N x V logits
    (NOTE [the head and its loss in row chunks]).

    Args:
        hidden: ``[N, H]`` floating point.
        weight: ``[V, H]``, the head's weight (tied to the input embedding or not), of
            ``hidden``'s dtype and device (under autocast: any floating dtype).
        bias: ``[V]`` or ``None``.
        target: ``[N]`` class indices; ``ignore_index`` marks rows left out.
        ignore_index: rows with this target count neither in the sum nor in the mean's divisor.
        reduction: ``"mean"`` (over the rows not ignored) or ``"sum"``.
        label_smoothing: in ``[0, 1]``, F.cross_entropy's definition.
        chunk_rows: rows per chunk; ``None``: :func:`chunk_rows_for` the vocabulary.
        softcap: logits become ``softcap * tanh(logits / softcap)`` before the loss.
        num_items_in_batch: HF's ``ForCausalLMLoss``: the sum divided by this (``reduction``
            is then not used).

    Returns:
        the loss, a scalar of ``hidden``'s dtype promoted to at least float32.

    Raises:
        ArgumentTypeError: a non-tensor, a non-floating ``hidden`` or a non-integer ``target``.
        InvalidArgumentError: shapes, dtypes or devices that do not match, an unknown
            reduction, ``label_smoothing`` outside ``[0, 1]``, ``chunk_rows < 1``, a softcap
            not above 0, a target out of range (CPU).

    Example:
        >>> h = torch.randn(6, 8, requires_grad=True); w = torch.randn(50, 8, requires_grad=True)
        >>> y = torch.tensor([1, 2, -100, 4, 5, 49])
        >>> a = linear_cross_entropy(h, w, None, y, chunk_rows=4)
        >>> b = functional.cross_entropy(h @ w.T, y)
        >>> ga = torch.autograd.grad(a, (h, w)); gb = torch.autograd.grad(b, (h, w))
        >>> bool(torch.allclose(a, b)), all(torch.allclose(x, z, atol=1e-6) for x, z in zip(ga, gb))
        (True, True)
    """
    _check(hidden, weight, bias, target, reduction, label_smoothing, chunk_rows, softcap)
    device = hidden.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return linear_cross_entropy(
                hidden.to(dtype),
                weight.to(dtype),
                None if bias is None else bias.to(dtype),
                target,
                ignore_index=ignore_index,
                reduction=reduction,
                label_smoothing=label_smoothing,
                chunk_rows=chunk_rows,
                softcap=softcap,
                num_items_in_batch=num_items_in_batch,
            )
    _check_dtypes(hidden, weight, bias)
    target = target.to(device=hidden.device, dtype=torch.long)
    if target.device.type == "cpu":
        _check_range(target, weight.shape[0], ignore_index)
    rows = chunk_rows_for(weight.shape[0]) if chunk_rows is None else chunk_rows
    summed = reduction == "sum" or num_items_in_batch is not None
    options = _Options(ignore_index, summed, float(label_smoothing), rows, softcap)
    loss: torch.Tensor = _LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
        hidden, weight, bias, target, options
    )
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):  # HF's fixed_cross_entropy, as it is
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        options: _Options,
    ) -> torch.Tensor:
        needs = tuple(bool(x) for x in ctx.needs_input_grad[:3])
        loss, grads = _chunks(hidden, weight, bias, target, options, needs)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: these gradients would be constants
            raise InvalidArgumentError(
                "tensorscope.fit: the chunked LM loss computes its gradients in its forward and "
                "cannot be differentiated again (create_graph=True); compute that loss from "
                "whole logits (F.cross_entropy) instead"
            )
        out: list[torch.Tensor | None] = []
        for saved, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True):
            if saved is None:
                out.append(None)
                continue
            saved.mul_(grad)  # 0-dim: computed in float32, as autograd scales the upcast
            out.append(saved if saved.dtype == dtype else saved.to(dtype))
        return out[0], out[1], out[2], None, None


def _chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    o: _Options,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The loss and the gradients of the loss (incoming gradient 1) w.r.t. ``hidden``,
    ``weight`` and ``bias`` where ``needs`` says so; one chunk of rows at a time."""
    n, vocab = hidden.shape[0], weight.shape[0]
    compute = torch.promote_types(hidden.dtype, torch.float32)
    accumulate = torch.promote_types(weight.dtype, torch.float32)
    valid = target != o.ignore_index
    count = valid.sum()
    scale = torch.ones((), dtype=compute, device=hidden.device)
    if not o.summed:
        scale = scale / count.clamp(min=1).to(compute)  # no rows: every row's weight is 0
    grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if needs[0] else None
    grad_w = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if needs[1] else None
    grad_b = None
    if needs[2] and bias is not None:
        grad_b = torch.zeros(bias.shape, dtype=accumulate, device=bias.device)
    total = torch.zeros((), dtype=compute, device=hidden.device)
    eps, keep = o.smoothing, 1.0 - o.smoothing
    for first in range(0, n, o.rows):
        last = min(n, first + o.rows)
        h, ok = hidden[first:last], valid[first:last]
        y = target[first:last].masked_fill(~ok, 0).unsqueeze(1)
        z = functional.linear(h, weight, bias).to(compute)  # the lm_head, then HF's upcast
        slope = None
        if o.softcap is not None:
            z.div_(o.softcap).tanh_()
            if any(needs):
                slope = 1.0 - z * z  # d(cap * tanh(x / cap)) / dx
            z.mul_(o.softcap)
        lse = torch.logsumexp(z, 1)
        rowloss = lse - keep * z.gather(1, y).squeeze(1)
        if eps:
            rowloss -= (eps / vocab) * z.sum(1)
        total += torch.where(ok, rowloss, 0.0).sum()
        del rowloss
        if not any(needs):
            continue
        g = z.sub_(lse.unsqueeze(1)).exp_()  # softmax, over the logits
        g.scatter_add_(1, y, torch.full_like(y, -keep, dtype=compute))
        if eps:
            g.sub_(eps / vocab)
        g.mul_((ok.to(compute) * scale).unsqueeze(1))
        if slope is not None:
            g.mul_(slope)
            del slope
        g = g.to(hidden.dtype)  # as autograd casts the upcast's gradient back
        if grad_h is not None:
            torch.mm(g, weight, out=grad_h[first:last])
        if grad_w is not None:
            if g.dtype == accumulate:
                grad_w.addmm_(g.t(), h)
            else:
                grad_w.add_(torch.mm(g.t(), h))
        if grad_b is not None:
            grad_b.add_(g.sum(0, dtype=accumulate))
        del g, z
    loss = total if o.summed else total / count.to(compute)  # mean of no rows: nan, as torch
    return loss, (grad_h, grad_w, grad_b)


def _check(
    hidden: Any,
    weight: Any,
    bias: Any,
    target: Any,
    reduction: str,
    label_smoothing: float,
    chunk_rows: int | None,
    softcap: float | None,
) -> None:
    named = {"hidden": hidden, "weight": weight, "target": target}
    if bias is not None:
        named["bias"] = bias
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise ArgumentTypeError(
                f"tensorscope.fit: linear_cross_entropy's {name} must be a tensor, "
                f"got {type(value).__name__}"
            )
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ArgumentTypeError(
            f"tensorscope.fit: linear_cross_entropy needs floating hidden and weight, got "
            f"{hidden.dtype} and {weight.dtype}"
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ArgumentTypeError(
            f"tensorscope.fit: linear_cross_entropy's target holds class indices (an integer "
            f"tensor), got {target.dtype}; probabilities as targets are not supported"
        )
    shapes_ok = (
        hidden.dim() == 2
        and weight.dim() == 2
        and weight.shape[1] == hidden.shape[1]
        and target.shape == hidden.shape[:1]
        and (bias is None or bias.shape == weight.shape[:1])
    )
    if not shapes_ok:
        got = f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, target "
        got += f"{tuple(target.shape)}, bias {None if bias is None else tuple(bias.shape)}"
        raise InvalidArgumentError(
            f"tensorscope.fit: linear_cross_entropy needs hidden [N, H], weight [V, H], "
            f"target [N] and bias [V] or None; got {got} (flatten batch and sequence first)"
        )
    if reduction not in ("mean", "sum"):
        raise InvalidArgumentError(
            f"tensorscope.fit: linear_cross_entropy's reduction is 'mean' or 'sum', got "
            f"{reduction!r} (per-row losses would be an N-element tensor: use F.cross_entropy)"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise InvalidArgumentError(
            f"tensorscope.fit: label_smoothing must be in [0, 1], got {label_smoothing}"
        )
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or chunk_rows < 1):
        raise InvalidArgumentError(
            f"tensorscope.fit: chunk_rows must be a positive int, got {chunk_rows!r}"
        )
    if softcap is not None and not softcap > 0.0:
        raise InvalidArgumentError(f"tensorscope.fit: softcap must be above 0, got {softcap}")
    devices = {t.device for t in (hidden, weight, bias) if t is not None}
    if len(devices) > 1:
        raise InvalidArgumentError(
            f"tensorscope.fit: linear_cross_entropy's hidden, weight and bias are on "
            f"{sorted(map(str, devices))}; put them on one device"
        )


def _check_dtypes(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) > 1:
        raise InvalidArgumentError(
            f"tensorscope.fit: linear_cross_entropy's hidden, weight and bias have dtypes "
            f"{sorted(map(str, dtypes))}; outside autocast they must match (as F.linear's)"
        )


def _check_range(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise InvalidArgumentError(
            f"tensorscope.fit: target {value} is out of range for a vocabulary of {vocab} "
            f"(class indices are 0..{vocab - 1}, or ignore_index={ignore_index})"
        )
