"""What a copy of a module leaves out: the hooks and attributes tensorscope attached to it.

# NOTE [copies of a module we attached to]
# ``ts.fit`` and ``checkpoint_chain`` attach to the user's modules: forward hooks on the model
# (bound methods of the handle), a ``forward`` instance attribute on each block of the chain
# (routed through the schedule), forward hooks on offloaded blocks. ``copy.deepcopy(model)`` --
# ``torch.optim.swa_utils.AveragedModel``, timm's ``ModelEmaV2``, a "best model so far" --,
# ``copy.copy``, ``pickle`` and ``torch.save(model)`` copy a module through its ``__getstate__``
# (``object.__reduce_ex__``), and would copy those too: the handle (threading.local, open files:
# a TypeError), or a copy whose blocks still run through the original's schedule. So while
# something is attached, the module's instance ``__dict__`` holds a ``__getstate__`` of ours
# (an instance attribute comes before the class's function, which is a non-data descriptor):
# it returns the class's state less what was attached -- the hooks' entries taken out of every
# hook dict, each attribute given back as it was before (or left out). A copy is the plain
# module, as a copy of a module under ``ts.manage`` is (its parameters copy as plain
# ``nn.Parameter``s); the original is not touched. The entry goes when the last attachment is
# removed.

Layer 3: imports no other tensorscope module.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["MISSING", "Attached", "leave_out_of_copies"]

MISSING: Any = object()  # an attribute the module did not have before
_GETSTATE = "__getstate__"
_lock = threading.Lock()


class _PlainState:
    """A module's ``__getstate__`` while something of ours is attached (see the NOTE)."""

    def __init__(self, module: nn.Module, previous: Any) -> None:
        self._module = weakref.ref(module)
        self.previous = previous  # an instance __getstate__ the module had (MISSING: none)
        self.attached: list[Attached] = []

    def __call__(self) -> Any:
        module = self._module()
        if module is None:  # pragma: no cover - called through the module itself
            return None
        previous = self.previous
        getstate: Any = type(module).__getstate__
        state = getstate(module) if previous is MISSING else previous()
        if not isinstance(state, dict):  # a class of the user's own making
            return state
        state = dict(state)
        if state.get(_GETSTATE) is self:
            del state[_GETSTATE]
        with _lock:
            attached = list(self.attached)
        ids = {hook_id for a in attached for hook_id in a.hook_ids}
        for a in attached:
            for name, before in a.attrs.items():
                if before is MISSING:
                    state.pop(name, None)
                else:
                    state[name] = before
        for name, value in list(state.items()):
            if "hooks" in name and isinstance(value, dict) and not ids.isdisjoint(value):
                kept = type(value)()  # an OrderedDict, as torch made it
                kept.update((k, v) for k, v in value.items() if k not in ids)
                state[name] = kept
        return state


class Attached:
    """What one caller attached to a module (see :func:`leave_out_of_copies`)."""

    def __init__(self, owner: _PlainState, hook_ids: set[int], attrs: dict[str, Any]) -> None:
        self._owner = owner
        self.hook_ids = hook_ids
        self.attrs = attrs

    def remove(self) -> None:
        """Copies of the module include these again (idempotent); the last removal takes our
        ``__getstate__`` off the module."""
        owner = self._owner
        with _lock:
            if self not in owner.attached:
                return
            owner.attached.remove(self)
            module = owner._module()
            last = not owner.attached and module is not None
            if last and module is not None and module.__dict__.get(_GETSTATE) is owner:
                if owner.previous is MISSING:
                    del module.__dict__[_GETSTATE]
                else:
                    module.__dict__[_GETSTATE] = owner.previous


def leave_out_of_copies(
    module: nn.Module, hooks: Iterable[Any] = (), attrs: dict[str, Any] | None = None
) -> Attached:
    """Make copies of ``module`` (``copy.deepcopy``, ``copy.copy``, ``pickle``, ``torch.save``)
    leave out ``hooks`` (handles of hooks registered on it) and give ``attrs`` (instance
    attributes set on it) the values they had before (``MISSING``: none). Returns a handle
    whose ``remove()`` undoes this.

    Example:
        >>> import copy, torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> hook = lin.register_forward_hook(lambda *args: None)
        >>> kept_out = leave_out_of_copies(lin, [hook])
        >>> len(copy.deepcopy(lin)._forward_hooks), len(lin._forward_hooks)
        (0, 1)
        >>> kept_out.remove(); hook.remove()
        >>> "__getstate__" in vars(lin)
        False
    """
    with _lock:
        owner = module.__dict__.get(_GETSTATE)
        if not isinstance(owner, _PlainState):
            owner = _PlainState(module, module.__dict__.get(_GETSTATE, MISSING))
            module.__dict__[_GETSTATE] = owner
        attached = Attached(owner, {h.id for h in hooks}, dict(attrs or {}))
        owner.attached.append(attached)
    return attached
