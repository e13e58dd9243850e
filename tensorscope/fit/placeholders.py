"""The stand-in of an optimizer state tensor whose bytes are in the next tier (statestore.py):
a meta tensor of the same shape, dtype and strides that copies as the real value. See NOTE
[copies of state in the next tier].
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from tensorscope._sites import mark_state_maker
from tensorscope.errors import ResidencyError
from tensorscope.ref import unown

__all__ = ["Placeholder", "placeholder_of"]

# NOTE [copies of state in the next tier]
# Between updates `optimizer.state[p]["exp_avg"]` is a Placeholder: the bytes are in the store.
# Training scripts copy the whole optimizer -- `torch.save(optimizer, f)`, `pickle`,
# `copy.deepcopy(optimizer)` -- and those copy `optimizer.state` as it is (torch's
# `Optimizer.__getstate__`): a meta tensor would be saved as a meta tensor, silently, and the
# loaded optimizer would have no state to resume from. So a Placeholder copies as its value:
# `__reduce_ex__` (pickle, torch.save) and `__deepcopy__` read the bytes from the store into a
# fresh plain tensor and copy that; the placeholder and the store are left as they were (the
# copy is the caller's, as `optimizer.state_dict()`'s tensors are). `pickle` writes each one
# as it reads it; `torch.save` holds what it saves until it writes the file, as it holds the
# tensors of a plain optimizer. A placeholder that is no longer in `optimizer.state` (its
# value was read back since, or the fit removed) has nothing to copy: ResidencyError, naming
# `optimizer.state_dict()`. Made inside a scope (a copy in the middle of a scoped step), the
# value is never owned by it: the copy is kept (the functions are state makers, _sites.py).


class Placeholder(torch.Tensor):
    """A meta tensor standing for a state tensor in the store (see the NOTE)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        value = _value(self)
        memo[id(self)] = value
        return value

    def __reduce_ex__(self, proto: Any) -> Any:
        value: Any = _value(self)
        return value.__reduce_ex__(proto)


mark_state_maker(Placeholder.__deepcopy__)
mark_state_maker(Placeholder.__reduce_ex__)


def _value(placeholder: Placeholder) -> torch.Tensor:
    read = placeholder.__dict__.get("_ts_read")
    reader = read() if read is not None else None
    value: torch.Tensor | None = None
    if reader is not None:
        value = reader(placeholder.__dict__.get("_ts_key"), placeholder)
    if value is None:
        raise ResidencyError(
            "tensorscope.fit: this optimizer state tensor is a placeholder ts.fit no longer "
            "holds (its value was read back into optimizer.state since, or the fit was "
            "removed): copy optimizer.state again, or save optimizer.state_dict()."
        )
    return value


def placeholder_of(
    value: torch.Tensor, read: Callable[[Any, Placeholder], torch.Tensor | None], key: Any
) -> Placeholder:
    """A meta stand-in for ``value`` whose copies are ``read(key, placeholder)`` (None: gone).
    ``read`` is held weakly (a bound method of the store).

    Example:
        >>> import copy
        >>> kept = torch.arange(4.0)
        >>> class Store:
        ...     def read(self, key, placeholder): return kept.clone()
        >>> store = Store()
        >>> stand_in = placeholder_of(kept, store.read, "exp_avg")
        >>> stand_in.device.type, copy.deepcopy(stand_in)
        ('meta', tensor([0., 1., 2., 3.]))
    """
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    # made inside a scope (a step there, the mode pushed back by a nested step's post-hook):
    # state is never the scope's, or its close would switch the stand-in to a disposed one
    unown((meta,))
    meta.__class__ = Placeholder
    placeholder: Placeholder = meta  # type: ignore[assignment]
    placeholder.__dict__["_ts_read"] = weakref.WeakMethod(read)
    placeholder.__dict__["_ts_key"] = key
    return placeholder
