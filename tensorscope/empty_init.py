"""``ts.empty_init()``: build a module whose parameters take no memory (they live on ``meta``).

A model larger than RAM cannot be built in RAM; built under ``empty_init`` its parameters are
meta tensors (shape and dtype only), and ``ts.manage(model, checkpoint=...)`` gives them their
values from the checkpoint's files. Parameters are moved to ``meta`` as they are registered,
through torch's global parameter-registration hook (and buffers through the buffer hook, with
``include_buffers=True``), so module constructors run unchanged: their ``torch.empty`` touches no
page, and initialisers (``reset_parameters``) run on meta tensors at no cost. The context is
per thread (and asyncio task) and nests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from tensorscope.errors import ArgumentTypeError

__all__ = ["empty_init"]

# (parameters, buffers) counts of empty_init blocks open in this thread/task
_ACTIVE: ContextVar[tuple[int, int]] = ContextVar("tensorscope_empty_init", default=(0, 0))
_hooks: list[object] = []


def _to_meta_parameter(
    module: nn.Module, name: str, param: nn.Parameter | None
) -> nn.Parameter | None:
    if param is None or _ACTIVE.get()[0] == 0 or param.device.type == "meta":
        return None
    kwargs = dict(param.__dict__)  # e.g. attributes a subclass of Parameter carries
    meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
    meta.__dict__.update(kwargs)
    return meta


def _to_meta_buffer(
    module: nn.Module, name: str, buffer: torch.Tensor | None
) -> torch.Tensor | None:
    if buffer is None or _ACTIVE.get()[1] == 0 or buffer.device.type == "meta":
        return None
    return buffer.to("meta")


def _install() -> None:
    if _hooks:
        return
    registry = torch.nn.modules.module
    # torch's stubs say the hooks return None; torch uses a returned tensor as the replacement.
    on_param: Any = _to_meta_parameter
    on_buffer: Any = _to_meta_buffer
    _hooks.append(registry.register_module_parameter_registration_hook(on_param))
    _hooks.append(registry.register_module_buffer_registration_hook(on_buffer))


@contextlib.contextmanager
def empty_init(include_buffers: bool = False) -> Iterator[None]:
    """Create ``nn.Parameter``s on the ``meta`` device while the block runs (buffers too with
    ``include_buffers=True``); nothing is allocated for them.

    Example:
        >>> import torch, tensorscope as ts
        >>> with ts.empty_init():
        ...     layer = torch.nn.Linear(4096, 4096)
        >>> layer.weight.device.type, layer.weight.shape
        ('meta', torch.Size([4096, 4096]))
    """
    if not isinstance(include_buffers, bool):
        raise ArgumentTypeError(
            "tensorscope.residency: empty_init(include_buffers=...) takes a bool; got "
            f"{type(include_buffers).__name__}."
        )
    _install()
    params, buffers = _ACTIVE.get()
    token = _ACTIVE.set((params + 1, buffers + bool(include_buffers)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
