"""The C++ op path's view of the ledger (csrc/managed.cpp; docs/design.md §14).

With the C++ engine, a thread's ops go through a native kernel (on the Fake dispatch key)
instead of the Interceptor mode. It runs an op with no Python at all when every managed operand
is resident and nothing would be decided after the op (the *fast path*), and hands every other
op to the Interceptor, as the Python engine does. What the fast path needs of the ledger is
mirrored here, placement by placement: whether its bytes are usable on the device right now
(``fast``), whether it is on the device tier at all, and the offload arena whose canary guards
its memory. The fast path logs the ops it ran (op, placement uids, clock); ``sync`` replays the
log into the manager exactly as the Python op path would have recorded those ops (clock, last
uses, the recorder's trace, the module order), at the next point where Python decides anything.

# NOTE [when a placement may take the fast path]
# ``fast`` is True only for a placement on the device tier with no prefetch pending, whose
# memory is its own or lies in an offload arena (checked per op with the arena's canary, as the
# Python path does); never for a region of a checkpoint file (checked by fingerprint, in Python).
# Anything that moves a placement's bytes *claims* it first (``claim``): that fails while a fast
# op uses it, and takes it off the fast path otherwise. Being conservative is always safe: an op
# the fast path refuses runs the Python op path, which is the reference behaviour.

Layer 13 (residency; inside it, above disk.py, whose arena moves it follows, and below
placement.py): imports the engine and the disk tier only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tensorscope._engine import FAST
from tensorscope._layout import FAST_OPS, INFLIGHT, SLOW_OPS, PlacementFields
from tensorscope.residency import disk

__all__ = ["ENGINE", "arena", "claim", "counters", "drop", "publish", "quiet", "set_policy"]

# The native op path, when the C++ engine is built and chosen (TENSORSCOPE_ENGINE).
ENGINE: Any = FAST if FAST is not None and hasattr(FAST, "res_set") else None

_state = {"policy_ok": False, "disabled": False}


def _resolve(name: str, overload: str) -> Any:
    namespace, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), op)
    return getattr(packet, overload or "default")


def setup(flush: Any) -> None:
    """Give the engine what its slow path and its log need (once, by the manager)."""
    if ENGINE is not None:
        ENGINE.res_setup(
            torch._C._push_on_torch_dispatch_stack,
            torch._C._pop_torch_dispatch_stack,
            _resolve,
            flush,
        )


def set_policy(policy: object) -> None:
    """The fast path decides nothing after an op: only Flow, whose ``after_op`` does nothing
    while every placement is on the device, allows it (a subclass or another policy may)."""
    from tensorscope.policies import Flow

    _state["policy_ok"] = type(policy) is Flow
    _flags()


def disable(off: bool) -> None:
    """Turn the fast path off (``True``) or on again: every op then takes the Python op path
    (tests compare the two)."""
    _state["disabled"] = off
    _flags()


def _flags() -> None:
    if ENGINE is not None:
        ENGINE.res_flags(_state["policy_ok"], _state["disabled"])


def quiet(ops: int) -> None:
    """The next ``ops`` ops on managed tensors come before the policy's next decision point
    (cadence.py): the fast path may run them while placements are off the device."""
    if ENGINE is not None:
        ENGINE.res_quiet(ops)


def publish(placement: Any, create: bool = True) -> None:
    """Mirror ``placement``'s state into the engine's table (after any change of its tier,
    region or pending prefetch); ``create=False``: only if it is in the table already."""
    if ENGINE is None:
        return
    on_device = placement.tier == "device"
    fast = on_device and placement.pending is None
    fd = -1
    region = placement.region
    # Where the region is the storage's memory (a CPU device), not a copy of it.
    if fast and region is not None and placement.storage.data_ptr() == region.address:
        file = region.file
        # An offload arena (disk.Arena: a canary after its data) and not a checkpoint file.
        if getattr(file, "_canary", None) is not None and file.cut is None and not region.readonly:
            fd = file.fd
            arena(file)
        else:
            fast = False  # a checkpoint file: its check is Python's
    fields = PlacementFields(uid=placement.uid, fast=fast, on_device=on_device, fd=fd)
    ENGINE.res_set(placement.key, fields, create)


def drop(placement: Any) -> None:
    """The placement is forgotten; waits for fast ops still using it (they hold its storage)."""
    if ENGINE is None:
        return
    while not ENGINE.res_drop(placement.key):
        time.sleep(0.0002)


def claim(placement: Any) -> bool:
    """Take ``placement`` off the fast path before its bytes move; False while a fast op on
    another thread uses it (then it counts as pinned)."""
    if ENGINE is None:
        return True
    return bool(ENGINE.res_claim(placement.key))


def arena(file: Any) -> None:
    """Mirror an arena's canary (its position moves as the file grows)."""
    if ENGINE is not None and file.fd >= 0:
        ENGINE.res_arena(file.fd, file.high, file._canary, file.cut is None)


def forget_arena(fd: int) -> None:
    if ENGINE is not None and fd >= 0:
        ENGINE.res_arena(fd)


def counters() -> tuple[int, int]:
    """(ops run by the fast path, ops handed to Python) so far, on all threads."""
    if ENGINE is None:
        return 0, 0
    return int(ENGINE.res_counter(FAST_OPS, 0)), int(ENGINE.res_counter(SLOW_OPS, 0))


def in_flight() -> int:
    """Fast ops running now, on all threads."""
    return 0 if ENGINE is None else int(ENGINE.res_counter(INFLIGHT, 0))


if ENGINE is not None:  # the fast path checks arenas' canaries: follow them as they move
    disk.watch_arenas(arena, forget_arena)
