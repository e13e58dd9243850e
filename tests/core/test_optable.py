"""The op table (tensorscope/_optable.py): one classification of each op, for every mode, the
op paths and the C++ engine; the engine's own copy agrees with it on every op with a schema."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tensorscope import _optable as table
from tensorscope._engine import FAST

pytestmark = pytest.mark.engine_independent  # classifies ops; opens no scope

aten = torch.ops.aten


def _flags(op: Any) -> int:
    return table.op_info(op).flags


@pytest.mark.parametrize(
    ("op", "has", "lacks"),
    [
        (aten.add_.Tensor, table.IN_PLACE | table.WRITES_RESULT, table.OUT_ARGUMENT),
        (aten.add.out, table.OUT_ARGUMENT | table.WRITES_RESULT, table.IN_PLACE | table.VIEW),
        (aten.add.Tensor, table.GRAD_MAKER, table.WRITES_RESULT | table.VIEW | table.FACTORY),
        (aten.transpose.int, table.VIEW, table.WRITES_RESULT | table.IN_PLACE),
        (aten.randn.default, table.FACTORY | table.RANDOM, table.WRITES_RESULT),
        (aten.empty_strided.default, table.FACTORY | table.GRAD_MAKER, table.RANDOM),
        (aten.normal_.default, table.IN_PLACE | table.RANDOM | table.OVERWRITES, table.FACTORY),
        (aten.fill_.Scalar, table.OVERWRITES | table.IN_PLACE, table.SETS_STORAGE),
        (aten.fill_.Tensor, table.OVERWRITES, 0),
        (aten.add_.Tensor, 0, table.OVERWRITES),  # reads what it writes
        (aten.set_.source_Storage, table.SETS_STORAGE | table.OVERWRITES, 0),
        (aten.lift_fresh.default, table.FRESH_INPUT, table.WRITES_RESULT),
        (aten._foreach_add.List, table.MULTI_TENSOR, table.WRITES_RESULT),
        (aten._foreach_add_.List, table.MULTI_TENSOR | table.IN_PLACE, table.WRITES_RESULT),
        (aten.detach.default, table.BARE_ALIAS | table.GRAD_MAKER | table.VIEW, 0),
        (aten.cat.default, 0, table.MULTI_TENSOR | table.VIEW),
    ],
)
def test_ops_are_classified_by_their_schema_and_name(op: Any, has: int, lacks: int) -> None:
    flags = _flags(op)
    assert flags & has == has, f"{op}: {flags:#x} lacks {has & ~flags:#x}"
    assert not flags & lacks, f"{op}: {flags:#x} has {flags & lacks:#x}"


def test_collectives_are_flagged() -> None:
    functional = torch.ops._c10d_functional  # registered with torch.distributed's C library
    assert _flags(functional.all_reduce.default) & table.COLLECTIVE
    assert not _flags(aten.mm.default) & table.COLLECTIVE


@pytest.mark.parametrize(
    ("op", "kind"),
    [
        (aten.mm.default, table.PLAIN),
        (aten.add_.Tensor, table.MUTATING),
        (aten.add.out, table.MUTATING),  # a grad maker's name, but it writes its result
        (aten.add.Tensor, table.GRAD_CANDIDATE),
        (aten.clone.default, table.GRAD_CANDIDATE),
        (aten.new_empty_strided.default, table.GRAD_CANDIDATE),
        (aten.detach.default, table.DETACH),
        (aten.alias.default, table.ALIAS),
        (torch.ops.profiler._record_function_enter_new.default, table.ENTER),
        (torch.ops.profiler._record_function_exit._RecordFunction, table.EXIT),
    ],
)
def test_the_route_of_an_op(op: Any, kind: int) -> None:
    assert table.op_info(op).kind == kind


def test_multi_tensor_ops_know_their_per_index_lists() -> None:
    info = table.op_info(aten._foreach_addcmul_.Scalar)
    assert info.lists == (0, 1, 2)
    assert table.op_info(aten._fused_adam_.default).lists is not None
    assert table.op_info(aten.mm.default).lists is None


def test_an_entry_is_made_once_and_found_by_id() -> None:
    op = aten.sub.Tensor
    first = table.op_info(op)
    assert table.TABLE[id(op)] is first and table.op_info(op) is first
    assert (first.name, first.label) == ("aten::sub", "aten.sub.Tensor")


def test_what_is_not_an_op_overload_has_no_flags_and_is_not_kept() -> None:
    def not_an_op() -> None: ...

    info = table.op_info(not_an_op)
    assert (info.flags, info.kind, info.lists) == (0, table.PLAIN, None)
    assert id(not_an_op) not in table.TABLE


def test_mutating_is_a_result_written_as_the_op_paths_always_said() -> None:
    """The op paths' kinds keep their old meaning on every op: mutating is a *result* the op
    wrote (in-place foreach ops return nothing and are not), and the name rules come after."""
    for name in torch._C._dispatch_get_all_op_names():
        base, _, overload = name.partition(".")
        schema = torch._C._get_schema(base, overload)
        written = any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)
        flags = table.schema_flags(schema)
        assert bool(flags & table.WRITES_RESULT) == written, name
        assert (table.kind_of(flags) == table.MUTATING) == written, name


@pytest.mark.skipif(FAST is None, reason="the C++ engine is not loaded (TENSORSCOPE_ENGINE)")
def test_the_engine_classifies_every_op_as_the_table_does() -> None:
    """csrc/optable.cpp computes the engine's flags by the same rules (the names from
    ``NAMED``, the schema rule itself) and the kind from them: both, on every op."""
    names = torch._C._dispatch_get_all_op_names()
    assert len(names) > 2000
    differ = []
    for name in names:
        base, _, overload = name.partition(".")
        schema = torch._C._get_schema(base, overload)
        flags = table.schema_flags(schema) & table.ENGINE_FLAGS
        expected = (flags, table.kind_of(flags))
        got = FAST.op_class(base, overload)
        if tuple(got) != expected:
            differ.append(f"{name}: engine {got}, table {expected}")
    assert not differ, "\n".join(differ[:20])
    assert FAST.op_class("aten::no_such_op", "") is None
