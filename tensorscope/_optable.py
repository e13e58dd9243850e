"""The op table: what kind of op an ``OpOverload`` is, worked out once per op from its schema.

Every dispatch mode of tensorscope (the residency Interceptor, the recorder's PlanMode), the
residency op path, the Python scope engine and the C++ engine ask this table, not a rule of
their own. An entry (``OpInfo``) holds the op's flags, the route the op paths give it
(``kind``), its names, and the positions of the per-index lists of a multi-tensor op.

# NOTE [one table, keyed by id]
# Looked up on every op of a dispatch mode, so an entry is found by ``id(op)``: an
# ``OpOverload``'s ``__hash__`` is Python code (a call per lookup), ``id`` is not. The entry
# holds the op, so its id is never reused while the entry exists. Objects that are not an
# ``OpOverload`` (no schema) get an entry of no flags that is not kept.
#
# NOTE [the engine's copy]
# The C++ engine classifies the ops it sees with the same rules (csrc/optable.cpp), caching per
# operator: it cannot ask Python on its fast path (no GIL there). The name rules are not
# written twice: ``NAMED`` is handed to the engine when this module is imported, and the one
# schema rule it computes itself (``writes_result``: a result is an argument the op wrote) is
# compared with this table's on every op with a schema (tests/core/test_optable.py), as are
# the kinds derived from the flags. Flag bits and kind values are declared in ``_layout.py``.

Layer 3: imports torch and the engine (layer 2) only, and the layout (layer 1).
"""

from __future__ import annotations

from typing import Any

import torch

from tensorscope import _layout
from tensorscope._engine import FAST

__all__ = [
    "ALIAS",
    "BARE_ALIAS",
    "COLLECTIVE",
    "DETACH",
    "ENGINE_FLAGS",
    "ENTER",
    "EXIT",
    "FACTORY",
    "FRESH_INPUT",
    "GRAD_CANDIDATE",
    "GRAD_MAKER",
    "IN_PLACE",
    "MULTI_TENSOR",
    "MUTATING",
    "NAMED",
    "OUT_ARGUMENT",
    "OVERWRITES",
    "PLAIN",
    "RANDOM",
    "REGION_END",
    "REGION_START",
    "SETS_STORAGE",
    "TABLE",
    "VIEW",
    "WRITES_RESULT",
    "OpInfo",
    "kind_of",
    "op_info",
    "schema_flags",
]


def _bit(name: str) -> int:
    return 1 << _layout.OP_FLAGS.index(name)


# ------------------------------------------------------------------------------ the flags
# The engine computes these too (their bits are _layout.OP_FLAGS').
#: A result is an argument the op wrote (in place, or out=): what the op paths call mutating.
WRITES_RESULT = _bit("writes_result")
#: ``detach`` / ``alias``: seen only inside autograd's engine (_intercept.py's NOTE).
BARE_ALIAS = _bit("bare_alias")
#: May make a ``.grad`` when autograd's engine runs it for an AccumulateGrad node.
GRAD_MAKER = _bit("grad_maker")
#: torch.optim's ``record_function`` regions open and close with these.
REGION_START = _bit("region_start")
REGION_END = _bit("region_end")
#: ``torch.tensor(data)`` makes its tensor unseen and hands it in: its result is its input.
FRESH_INPUT = _bit("fresh_input")
ENGINE_FLAGS = (1 << len(_layout.OP_FLAGS)) - 1

# Python's own (the engine never asks for them).
_next = len(_layout.OP_FLAGS)
#: A positional argument is written (``add_``, ``_foreach_add_``).
IN_PLACE = 1 << _next
#: A keyword-only argument is written (``out=``).
OUT_ARGUMENT = 1 << (_next + 1)
#: A result aliases an argument that is not written (torch's ``OpOverload.is_view`` rule).
VIEW = 1 << (_next + 2)
#: No tensor argument, and a tensor result (``empty``, ``randn``).
FACTORY = 1 << (_next + 3)
#: Draws from a random generator (torch's ``nondeterministic_seeded`` tag).
RANDOM = 1 << (_next + 4)
#: A collective of torch.distributed (``c10d``, functional collectives).
COLLECTIVE = 1 << (_next + 5)
#: Writes its destination whole without reading it (``copy_``, ``fill_``...): its old bytes
#: may have been lost (residency's ``Movers.replace_lost``).
OVERWRITES = 1 << (_next + 6)
#: ``t.set_(source)``: ``t`` takes another storage.
SETS_STORAGE = 1 << (_next + 7)
#: A multi-tensor op (``_foreach_*``, ``_fused_*``) with per-index lists (``OpInfo.lists``).
MULTI_TENSOR = 1 << (_next + 8)

# ------------------------------------------------------------------------------ the kinds
# The route an op path gives an op, by the first of these rules that holds (``kind_of``).
PLAIN, MUTATING, GRAD_CANDIDATE, ALIAS, DETACH, ENTER, EXIT = range(len(_layout.KINDS))

#: Flags given by name: a schema name (every overload) or ``name.overload`` (that one only).
NAMED: dict[str, int] = {
    "aten::detach": BARE_ALIAS | GRAD_MAKER,
    "aten::alias": BARE_ALIAS,
    "aten::clone": GRAD_MAKER,
    "aten::add": GRAD_MAKER,
    "aten::empty_strided": GRAD_MAKER,
    "aten::new_empty_strided": GRAD_MAKER,
    "profiler::_record_function_enter_new": REGION_START,
    "profiler::_record_function_exit": REGION_END,
    "aten::lift_fresh": FRESH_INPUT,
    "aten::copy_.default": OVERWRITES,
    "aten::fill_.Scalar": OVERWRITES,
    "aten::fill_.Tensor": OVERWRITES,
    "aten::zero_.default": OVERWRITES,
    "aten::normal_.default": OVERWRITES,
    "aten::uniform_.default": OVERWRITES,
    "aten::set_": OVERWRITES | SETS_STORAGE,
}
_COLLECTIVES = frozenset(
    {"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}
)
_MULTI_PREFIXES = ("aten::_foreach_", "aten::_fused_", "aten::_amp_foreach_")
_LIST_TYPES = ("List[Tensor]", "List[Optional[Tensor]]", "List[number]", "List[float]")


def kind_of(flags: int) -> int:
    """The route of an op with these flags (the engine derives it the same way)."""
    if flags & WRITES_RESULT:
        return MUTATING
    if flags & BARE_ALIAS:
        return DETACH if flags & GRAD_MAKER else ALIAS
    if flags & GRAD_MAKER:
        return GRAD_CANDIDATE
    if flags & REGION_START:
        return ENTER
    if flags & REGION_END:
        return EXIT
    return PLAIN


def _is_tensor_type(text: str) -> bool:
    return "Tensor" in text


def schema_flags(schema: Any, tags: Any = ()) -> int:
    """The flags of an op with this ``torch._C.FunctionSchema`` (and these tags)."""
    name = schema.name
    overload = schema.overload_name or "default"
    flags = NAMED.get(name, 0) | NAMED.get(f"{name}.{overload}", 0)
    if any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
        flags |= WRITES_RESULT
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if any(not a.kwarg_only for a in written):
        flags |= IN_PLACE
    if any(a.kwarg_only for a in written):
        flags |= OUT_ARGUMENT
    aliased = [a.alias_info for a in schema.arguments if a.alias_info is not None]
    if aliased and not any(info.is_write for info in aliased):
        flags |= VIEW
    has_tensor_argument = any(_is_tensor_type(str(a.type)) for a in schema.arguments)
    if not has_tensor_argument and any(_is_tensor_type(str(r.type)) for r in schema.returns):
        flags |= FACTORY
    if torch.Tag.nondeterministic_seeded in tags:
        flags |= RANDOM
    if name.partition("::")[0] in _COLLECTIVES:
        flags |= COLLECTIVE
    if _list_positions(schema) is not None:
        flags |= MULTI_TENSOR
    return flags


def _list_positions(schema: Any) -> tuple[int, ...] | None:
    """Positions of the per-index list arguments of a multi-tensor op (None: not one)."""
    if not schema.name.startswith(_MULTI_PREFIXES):
        return None
    found = tuple(
        index
        for index, argument in enumerate(schema.arguments)
        if str(argument.type) in _LIST_TYPES
        or (argument.name == "scalars" and str(argument.type) == "Tensor")
    )
    returns_ok = all(str(r.type) == "List[Tensor]" for r in schema.returns)
    return found if found and returns_ok else None


class OpInfo:
    """One op's entry: ``flags``, ``kind`` (the op paths' route), ``name`` (the schema's,
    ``"aten::add"``), ``label`` (``str(op)``, ``"aten.add.Tensor"``, for messages and
    policies), ``lists`` (a multi-tensor op's per-index list positions, else None)."""

    __slots__ = ("flags", "kind", "label", "lists", "name", "op")

    def __init__(self, op: Any) -> None:
        self.op = op
        schema = getattr(op, "_schema", None)
        if schema is None:  # not an OpOverload: nothing known
            self.flags, self.name, self.lists = 0, str(op), None
        else:
            self.flags = schema_flags(schema, getattr(op, "_tags", ()))
            self.name = schema.name
            self.lists = _list_positions(schema)
        self.kind = kind_of(self.flags)
        self.label = str(op)

    def __repr__(self) -> str:
        return f"<OpInfo {self.label} flags={self.flags:#x} kind={_layout.KINDS[self.kind]}>"


#: id(op) -> its entry (NOTE [one table, keyed by id]).
TABLE: dict[int, OpInfo] = {}


def op_info(op: Any) -> OpInfo:
    """``op``'s entry, made on its first lookup. On a hot path, ``TABLE.get(id(op))`` first."""
    info = TABLE.get(id(op))
    if info is None:
        info = OpInfo(op)
        if hasattr(op, "_schema"):
            TABLE[id(op)] = info
    return info


if FAST is not None:  # NOTE [the engine's copy]
    FAST.set_op_names({name: f & ENGINE_FLAGS for name, f in NAMED.items() if f & ENGINE_FLAGS})
