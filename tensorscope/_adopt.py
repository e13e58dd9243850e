"""Adoption: how a fresh op result becomes a ref of the current scope (both engines' rules).

# NOTE [one set of rules, two engines]
# Both scope engines own results at the same place: a boxed fallback on the DeferredInit
# dispatch key, above Autograd, which sees each *top-level* op (``linear``, not ``addmm`` and
# ``t``) — in C++ (csrc/fast.cpp) or in Python (_pyengine.py). They hand fresh plain results to
# the functions here (the C++ engine does the common case of ``adopt_at`` itself, in C), so
# which tensors a scope owns, its ``len()`` and ``ts.stats()`` are the same whichever engine
# runs. ``detach`` and ``alias`` fall through the key in both engines: C functions of torch make
# subclasses or numpy arrays from their results (``nn.Parameter``'s ``_make_subclass``,
# ``as_subclass``, ``numpy()``) and need them without a Python object; a ref's ``detach()`` is
# owned by ``TensorRef.detach`` instead (ref.py).
#
# NOTE [what is never owned]
# See _thread.py's table for the order of the rules. Parameters and buffers are converted back
# to plain classes when created (ref.py); a leaf's ``.grad`` is recognised while autograd's
# AccumulateGrad node runs and is never owned (what ``loss.backward()`` gives too: it runs with
# the key excluded; AccumulateGrad's ``detach`` of a stolen gradient is not seen anyway), and
# disposing a leaf cuts its hold on its ``.grad`` (ref.py);
# optimizer steps run with the key excluded (_optimizer.py); a result that *is* one of the op's
# inputs (a no-op ``.to()``) is never taken; and results made under the state makers of
# _sites.py are left plain.

Layer 9: imports only layers 0-8.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorscope._sites import NOT_OWNED, NotOwned, Site, capture_site
from tensorscope._state import STATES, Counters, Owner, RefState, on_ref_death
from tensorscope._thread import CURRENT_SCOPE, thread_state
from tensorscope._torch import ACCUMULATE_GRAD, current_autograd_node, graph_task_id, tracing
from tensorscope.ref import TensorRef, release_pending

__all__ = [
    "accumulate_grad_leaf",
    "adopt",
    "adopt_at",
    "adopt_fresh",
    "adopt_result",
]


def accumulate_grad_leaf() -> torch.Tensor | None:
    """The leaf whose ``.grad`` autograd is making right now, if an AccumulateGrad node runs."""
    if graph_task_id() == -1:
        return None
    node = current_autograd_node()
    if type(node) is not ACCUMULATE_GRAD:
        return None
    leaf: torch.Tensor = node.variable  # type: ignore[attr-defined]
    return leaf


def adopt(
    tensor: torch.Tensor,
    owner: Owner,
    counters: Counters,
    _capture: Any = capture_site,
    _not_owned: Any = NOT_OWNED,
    _tracing: Any = tracing,
) -> bool:
    """Make a fresh result a ref owned by ``owner``; False when a state maker made it, or
    ``torch.jit.trace`` is recording (see _thread.py's NOTE on TorchScript)."""
    site = _capture(2)
    if site is _not_owned or _tracing():
        return False
    adopt_at(tensor, owner, counters, site)
    return True


def adopt_at(
    tensor: torch.Tensor,
    owner: Owner,
    counters: Counters,
    site: Site,
    _new: Any = RefState,
    _on_death: Any = on_ref_death,
    _states: dict[int, RefState] = STATES,
) -> None:
    """Make a fresh op result made at ``site`` a ref owned by ``owner``.

    The hot path: ``register_ref`` inlined (default arguments bind the globals)."""
    tensor.__class__ = TensorRef
    state = _new(tensor, _on_death)
    key = id(tensor)
    state.key = key
    state.owner = owner
    state.site = site
    state.counters = counters
    state.disposal = None
    _states[key] = state
    owner._owned[key] = state
    counters.created_in_scope += 1


def adopt_fresh(
    fresh: list[torch.Tensor],
    site: Site | NotOwned,
    _state: Any = thread_state,
    _current: Any = CURRENT_SCOPE.get,
    _task: Any = graph_task_id,
) -> None:
    """Fresh plain results of one top-level op made at ``site`` (``NOT_OWNED``: a state maker
    called the op) on a thread with a scope open: the rules of _thread.py's table."""
    state = _state()
    if state.pending:
        release_pending(state)
    scope = _current()
    if scope is None:
        return
    if scope._closed:
        scope = scope.resolve()
        if scope is None:
            return
    if isinstance(site, NotOwned):
        return
    if _task() != -1 and accumulate_grad_leaf() is not None:
        return  # a .grad in the making: never owned (see the NOTE above)
    counters = state.counters
    for tensor in fresh:
        adopt_at(tensor, scope, counters, site)


def adopt_result(tensor: torch.Tensor, site: Site, state_maker: bool) -> None:
    """The C++ engine's hook: a fresh plain result of a top-level op on a thread with a scope
    open (csrc/fast.cpp) that its C adoption left to Python, with the site of the user frame
    that called the op (``state_maker``: a state maker called it, it is never owned)."""
    adopt_fresh([tensor], NOT_OWNED if state_maker else site)
