"""The plain-tensor protocols of refs: printing, pickling, copying, numpy, DLPack.

A ref behaves in these exactly as a plain tensor with the same data (torch would print a
subclass as ``TensorRef(...)`` and format only plain 0-d tensors as numbers), and ``torch.save``
of a ref stores plain data. Every protocol first checks that the ref was not disposed.

Layer 6: imports only layers 0-5.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from tensorscope._sites import mark_state_maker
from tensorscope._torch import no_dispatch, no_subclass_function, plain_alias

__all__ = ["PlainTensorProtocols"]


class PlainTensorProtocols:
    """Mixin for ``TensorRef``: the protocols above, as for a plain tensor."""

    __slots__ = ()

    def _check_live(self) -> None:
        raise NotImplementedError  # TensorRef raises DisposedTensorError when disposed

    @contextlib.contextmanager
    def _as_plain(self) -> Iterator[torch.Tensor]:
        self._check_live()
        tensor: Any = self
        cls = tensor.__class__
        tensor.__class__ = torch.Tensor
        try:
            yield tensor
        finally:
            tensor.__class__ = cls

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        plain_repr: Any = torch.Tensor.__repr__
        with self._as_plain() as tensor:
            return str(plain_repr(tensor, tensor_contents=tensor_contents))

    def __format__(self, format_spec: str) -> str:
        plain_format: Any = torch.Tensor.__format__
        with self._as_plain() as tensor:
            return str(plain_format(tensor, format_spec))

    def __reduce_ex__(self, proto: Any) -> Any:
        # torch.save / pickle store plain data: a ref loads back as a plain tensor.
        self._check_live()
        return torch.Tensor._reduce_ex_internal(self, proto)  # type: ignore[arg-type,no-untyped-call]

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        self._check_live()
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        tensor: Any = self
        if not tensor.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the "
                "deepcopy protocol at the moment (same rule as torch.Tensor)."
            )
        with torch.no_grad():
            new = tensor.clone()  # plain: this function is a state maker
        if tensor.requires_grad:
            new.requires_grad_(True)
        if tensor.grad is not None:
            new.grad = copy.deepcopy(tensor.grad, memo)
        memo[id(self)] = new
        return new  # type: ignore[no-any-return]

    def numpy(self, *, force: bool = False) -> Any:
        # The array keeps a plain alias made outside the interceptor, so its data stays valid
        # while the array lives even if this ref is disposed (numpy reads memory directly).
        self._check_live()
        with no_dispatch(), no_subclass_function():
            return torch.Tensor.numpy(self, force=force)  # type: ignore[arg-type]

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_live()
        with no_dispatch(), no_subclass_function():
            return torch.Tensor.__dlpack__(plain_alias(self), *args, **kwargs)  # type: ignore[arg-type]


# deepcopy makes a copy to keep: never owned by a scope, as for a plain tensor.
mark_state_maker(PlainTensorProtocols.__deepcopy__)
