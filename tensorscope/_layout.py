"""What the C++ engine and Python share, declared once: the engine's compiled-in layout.

The C++ engine (csrc/fast.cpp, csrc/managed.cpp, csrc/optable.cpp) reads and writes Python
objects and is handed tuples whose positions mean something: a placement's fields in its native
table, its process-wide counters, the slots of a ref's state it writes, the attributes of a
thread's state it reads, the op table's flags and kinds. Each is written here once; the Python
side builds its calls from these names (``residency/native.py``, ``_optable.py``), and the
engine exports the layout it was compiled with (``_fast.layout()``), which ``_engine.py``
compares with ``LAYOUT`` when it loads the engine: an extension built from other sources is
refused with a message saying how to rebuild it, never run against the wrong layout.

Layer 1: pure Python (no torch plumbing).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "COUNTERS",
    "FAST_OPS",
    "INFLIGHT",
    "KINDS",
    "LAYOUT",
    "LOG",
    "OP_FLAGS",
    "PENDING",
    "REF_STATE",
    "SCOPES",
    "SLOW_OPS",
    "PlacementFields",
]


class PlacementFields(NamedTuple):
    """A placement in the engine's native table (``res_set(key, *fields, create)``): its uid,
    whether its bytes are usable on the device right now (the fast path may take it), whether
    it is on the device tier at all, the offload arena its memory lies in (-1: none)."""

    uid: int
    fast: bool
    on_device: bool
    fd: int


#: The engine's process-wide counters, by index (``res_counter(index, delta)``).
COUNTERS = ("pending", "scopes", "inflight", "fast", "slow")
PENDING, SCOPES, INFLIGHT, FAST_OPS, SLOW_OPS = range(len(COUNTERS))

#: The slots the engine writes when it adopts a result in C (csrc/fast.cpp ``adopt_in_c``):
#: ``RefState``'s, then ``Counters``' (after the bar).
REF_STATE = ("key", "owner", "site", "counters", "disposal", "|", "created_in_scope")

#: What the engine reads by name: a thread's state (``ThreadState``), a scope
#: (``DisposeScope``), the residency Interceptor (its ``state``, whose thread is ``alive``).
ATTRIBUTES = ("pending", "counters", "_closed", "_owned", "state", "alive")

#: What ``res_drain()`` returns: this thread's fast ops since the last drain.
LOG = ("ops", "uids", "clocks", "last")

#: The op table's flags the engine computes, lowest bit first (``_optable.py``; the engine
#: computes them by the same rules, and a test compares the two on every op with a schema).
OP_FLAGS = (
    "writes_result",
    "bare_alias",
    "grad_maker",
    "region_start",
    "region_end",
    "fresh_input",
)

#: How an op path routes an op, by value (``_optable.py``: ``kind``).
KINDS = ("plain", "mutating", "grad_candidate", "alias", "detach", "enter", "exit")

#: The whole layout, as ``_fast.layout()`` returns it.
LAYOUT: dict[str, tuple[str, ...]] = {
    "placement": PlacementFields._fields,
    "counters": COUNTERS,
    "ref_state": REF_STATE,
    "attributes": ATTRIBUTES,
    "log": LOG,
    "op_flags": OP_FLAGS,
    "kinds": KINDS,
}
