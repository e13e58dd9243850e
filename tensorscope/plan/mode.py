"""What the recorder sees with: a dispatch mode of its own, pushed only while ``ts.record()``
is open on a thread, and the global hooks of that time (module calls, optimizer steps,
saved tensors, torch.compile'd calls).

# NOTE [its own mode]
# The recorder composes with whatever else runs: a scope's engine (the C++ one is a dispatch
# key above autograd, the Python one a mode of its own), the residency manager's op path, other
# modes. Its mode sits at the Python dispatch key, below autograd, so it sees every op a step
# runs as aten ops (``linear`` as ``t`` + ``addmm``), autograd's backward and optimizer steps
# included, and the tensors each op reads and makes. It never changes an op's arguments or
# results. Pushed on ``ts.record()``'s entry and taken off at exit (from under other modes if
# they were pushed after it), so nothing stays installed: the step after a recording runs as
# fast as one before it.
#
# NOTE [what each op costs]
# Per op: the op's name and kind (the op table, _optable.py), the clock, the user frame (the walk of
# tensorscope._sites, verdicts cached per code object), and per tensor argument or result one
# ``untyped_storage()`` and one dict lookup; a fresh storage adds a weak reference. In forward,
# each result with a ``grad_fn`` gets the op's index in the node's ``metadata``, so an op of the
# backward knows whose backward it runs (``torch._C._current_autograd_node()``).
#
# NOTE [DDP's buckets]
# DDP's reducer copies each gradient into a flat bucket and all-reduces the bucket: memory the
# reducer allocates once and keeps between steps, which no op of the step makes. The recorder
# first sees a bucket in the backward (a ``copy_`` into it), where a storage seen for the first
# time counts as made just then (NOTE [first sight], recorder.py); so a storage an all-reduce
# reads that was first seen that way is counted as existing before the step instead, from op 0
# -- what the step really holds, which ``ts.fit``'s budget must count (docs/api.md §11).
#
# NOTE [through DTensor]
# A mode runs before a tensor subclass's own ``__torch_dispatch__``: an op on FSDP2's sharded
# parameters, gradients and optimizer state (``DTensor``s, wrapper subclasses without memory
# of their own) would be seen as one op on storage-less wrappers. For those the mode returns
# ``NotImplemented``: DTensor runs first and desugars into ops on its local tensors, which come
# back through the mode (what torch's own ``FSDPMemTracker`` does). Everything is counted on
# the local tensors, this rank's bytes.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import torch

from tensorscope._modes import DispatchMode, skip_in_dynamo
from tensorscope._optable import ENTER, FRESH_INPUT, MUTATING, TABLE, op_info
from tensorscope._sharded import dtensor_class
from tensorscope._sites import Site, capture_site
from tensorscope._torch import ACCUMULATE_GRAD, current_autograd_node, graph_task_id, plain_alias
from tensorscope.plan.recorder import BACKWARD, FORWARD, OPTIMIZER, Recorder, Watch

__all__ = [
    "METADATA_KEY",
    "OPEN",
    "PlanMode",
    "observe_compiled",
    "pack",
    "recorder_here",
    "see_through",
    "unpack",
]

#: The key of a forward op's index in an autograd node's ``metadata``.
METADATA_KEY = "tensorscope.plan.forward_op"
#: The recorder open on each thread (thread id -> recorder).
OPEN: dict[int, Recorder] = {}

# What _record_op does with an op's results: nothing (it wrote its inputs), note them, or note
# them as made by this op even when they are its input (lift_fresh: the op table's FRESH_INPUT).
_PLAIN, _MUTATING, _FRESH = 0, 1, 2
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_clock = time.perf_counter
_is_grad_enabled = torch.is_grad_enabled
_GRADIENT = "gradient"
_weak = weakref.ref
_compiling = torch.compiler.is_compiling
# NOTE [through DTensor]: the wrapper subclasses whose ops the mode lets desugar first
_THROUGH: list[tuple[type, ...]] = [()]
# what a collective's tensor argument holds (NOTE [what FSDP2 holds], _sharded.py):
# op name -> (argument index, role)
_COLLECTIVE_ROLES = {
    "c10d::_allgather_base_": (0, "unsharded_parameter"),
    "c10d::allgather_into_tensor_coalesced_": (0, "unsharded_parameter"),
    "c10d::_reduce_scatter_base_": (1, "reduce_scatter"),
    "c10d::reduce_scatter_tensor_coalesced_": (1, "reduce_scatter"),
    "c10d::allreduce_": (0, ""),  # NOTE [DDP's buckets]
}


def see_through() -> None:
    """Note the wrapper subclasses loaded now whose ops the mode sees as their local ops
    (NOTE [through DTensor]); a recording calls it as it opens."""
    found = dtensor_class()
    _THROUGH[0] = (found,) if found is not None else ()


def recorder_here() -> Recorder | None:
    """The recording open on this thread; in autograd's engine on another thread (CUDA's device
    threads run the backward of a step recorded on the main thread), the one open recording.
    Only autograd's own threads (made in C++: Python sees a dummy thread) borrow it: a user's
    thread running its own backward beside a recording must not add its model to that step."""
    rec = OPEN.get(threading.get_ident())
    if (
        rec is None
        and len(OPEN) == 1
        and graph_task_id() != -1
        and isinstance(threading.current_thread(), threading._DummyThread)
    ):
        rec = next(iter(OPEN.values()))
    return rec


class PlanMode(DispatchMode):
    """Records every op of the thread it is pushed on (see the module NOTEs). Off while
    torch.compile compiles (nothing of that is the step), on while compiled code runs: its
    outputs count through observe_compiled (_modes.py's NOTE)."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.rec = rec

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if types and _THROUGH[0] and any(issubclass(t, _THROUGH[0]) for t in types):
            return NotImplemented  # NOTE [through DTensor]
        info = TABLE.get(id(func))
        if info is None:
            info = op_info(func)
        name = info.name
        rec = self.rec
        if info.kind >= ENTER:
            out = func._op(*args, **kwargs) if kwargs else func._op(*args)
            _region(rec, info.kind == ENTER, args)
            return out
        kind = info.kind
        kind = _MUTATING if kind == MUTATING else _FRESH if info.flags & FRESH_INPUT else _PLAIN
        index = rec.n_ops
        rec.n_ops = index + 1
        start = _clock()
        try:
            out = func._op(*args, **kwargs) if kwargs else func._op(*args)
        except BaseException:
            _record_op(rec, index, name, _MUTATING, start, args, kwargs, None)
            raise
        _record_op(rec, index, name, kind, start, args, kwargs, out)
        return out


def _region(rec: Recorder, enter: bool, args: tuple[Any, ...]) -> None:
    """torch.optim runs ``step`` and ``zero_grad`` inside ``record_function`` regions."""
    if enter:
        label = args[0] if args and isinstance(args[0], str) else ""
        region = 2 if label.startswith("Optimizer.step#") else int(label.startswith("Optimizer."))
        rec.region_kinds.append(region)
        if region:
            if rec.optimizer_depth == 0:
                rec.optimizer_start = rec.n_ops
            rec.optimizer_depth += 1
        return
    if not rec.region_kinds:
        return
    region = rec.region_kinds.pop()
    if region:
        rec.optimizer_depth -= 1
        if region == 2 and rec.optimizer_depth == 0:
            rec.optimizer_steps.append((rec.optimizer_start, rec.n_ops))


def _use(w: Watch, index: int, backward: bool) -> None:
    w.last_use = index
    if backward:
        if w.first_backward_use < 0:
            w.first_backward_use = index
        w.last_backward_use = index
    else:
        w.last_forward_use = index


def _record_op(
    rec: Recorder,
    index: int,
    name: str,
    kind: int,
    start: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    out: Any,
) -> None:
    if rec.pending_nodes:
        name_nodes(rec)
    backward = graph_task_id() != -1
    phase = OPTIMIZER if rec.optimizer_depth else BACKWARD if backward else FORWARD
    forward_op = -1
    leaf: Any = None
    if backward:
        node = current_autograd_node()
        if node is not None:
            if type(node) is ACCUMULATE_GRAD:
                leaf = node.variable  # type: ignore[attr-defined]
            else:
                forward_op = node.metadata.get(METADATA_KEY, -1)
    site: Site = capture_site(1, through_state_makers=True)  # type: ignore[assignment]
    stack = rec.stack
    rec.ops.append((name, start - rec.t0, site, stack[-1] if stack else -1, phase, forward_op))
    inputs: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, _Tensor):
            inputs.append(arg)
        elif type(arg) is list or type(arg) is tuple:
            inputs.extend(item for item in arg if isinstance(item, _Tensor))
    if kwargs:
        inputs.extend(arg for arg in kwargs.values() if isinstance(arg, _Tensor))
    live = rec.live
    reads_gradient = False
    needs_grad = False
    first = index if kind == _FRESH else -1
    for tensor in inputs:
        if tensor.requires_grad:
            needs_grad = True
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            continue
        w = live.get(id(storage))
        if w is None:
            w = rec.first_sight(tensor, storage, first, site)
        w.last_use = index
        if backward:
            if w.first_backward_use < 0:
                w.first_backward_use = index
            w.last_backward_use = index
        else:
            w.last_forward_use = index
            if w.role == _GRADIENT:
                reads_gradient = True
    if reads_gradient and phase == FORWARD:
        rec.gradient_readers.append(name)
    collective = _COLLECTIVE_ROLES.get(name)
    if collective is not None:
        _mark_collective(rec, args, *collective)
    if kind == _MUTATING or out is None:
        return
    outs = out if type(out) is tuple or type(out) is list else (out,)
    # only results of an op with an input that requires grad get a grad_fn
    mark_nodes = needs_grad and not backward and _is_grad_enabled()
    made: list[Watch] = []
    for item in outs:
        if not isinstance(item, _Tensor):
            continue
        try:
            storage = item.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        w = live.get(id(storage))
        if w is None:
            w = rec.first_sight(item, storage, index, site)
        _use(w, index, backward)
        if w.created == index:
            made.append(w)
        if mark_nodes:
            # autograd sets the result's grad_fn after this mode returns: named at the next op
            rec.pending_nodes.append((_weak(item), index))
    if leaf is not None and made and isinstance(leaf, _Parameter):
        owner = rec.watch(leaf, -1)
        for w in made:
            w.role = _GRADIENT
            if owner is not None:
                w.owner = owner.index
                w.name = owner.name
    if phase == OPTIMIZER and made:
        _tag_update(rec, args, outs, made)


def _mark_collective(rec: Recorder, args: tuple[Any, ...], at: int, role: str) -> None:
    """The buffer a collective writes or reads is what FSDP2 holds (NOTE [what FSDP2 holds]),
    or a DDP bucket (NOTE [DDP's buckets])."""
    arg = args[at] if at < len(args) else None
    for tensor in arg if type(arg) is list or type(arg) is tuple else (arg,):
        if not isinstance(tensor, _Tensor):
            continue
        if role:
            rec.mark(tensor, role, None)
            continue
        w = rec.watch(tensor, -1)
        if w is not None and w.unseen and w.created >= 0:
            w.created = -1  # NOTE [DDP's buckets]: kept by the reducer between steps


def name_nodes(rec: Recorder) -> None:
    """Give the autograd nodes of the previous ops' results their op's index."""
    for ref, index in rec.pending_nodes:
        tensor = ref()
        if tensor is not None:
            node = tensor.grad_fn
            if node is not None:
                metadata: dict[str, int] = node.metadata  # type: ignore[assignment]
                metadata.setdefault(METADATA_KEY, index)
    rec.pending_nodes.clear()


def _owner_index(w: Watch | None) -> int:
    if w is None:
        return -1
    return w.index if w.role in ("parameter", "sharded_parameter") else w.owner


def _tag_update(rec: Recorder, args: tuple[Any, ...], outs: Any, made: list[Watch]) -> None:
    """Which parameter's update made each fresh result of an optimizer op: a foreach op's
    result ``k`` belongs to the parameter of its first list argument's item ``k``; another op's
    results to the parameter of its first tensor argument that belongs to one."""
    fresh = {id(w) for w in made}
    first_list = next(
        (a for a in args if type(a) in (list, tuple) and a and isinstance(a[0], _Tensor)), None
    )
    if first_list is not None and len(first_list) == len(outs):
        for item, source in zip(outs, first_list, strict=True):
            if isinstance(item, _Tensor) and isinstance(source, _Tensor):
                w = rec.watch(item, -1)
                if w is not None and id(w) in fresh and w.owner < 0:
                    w.owner = _owner_index(rec.watch(source, -1))
        return
    owner = -1
    for arg in args:
        if isinstance(arg, _Tensor):
            owner = _owner_index(rec.watch(arg, -1))
            if owner >= 0:
                break
    if owner >= 0:
        for w in made:
            if w.owner < 0:
                w.owner = owner


# ------------------------------------------------------------------------ saved tensors
def pack(tensor: torch.Tensor) -> Any:
    """Autograd saves ``tensor`` for backward: note it (the innermost module call saved it).

    Returns a plain alias without autograd metadata: the tensor itself would make a reference
    cycle through its own ``grad_fn`` for a saved output (freed by the cycle collector only).
    """
    rec = recorder_here()
    if rec is not None and not _compiling():
        w = rec.watch(tensor, -1)
        if w is not None:
            w.saved = True
            if rec.stack and rec.stack[-1] not in w.saved_by:
                w.saved_by = (*w.saved_by, rec.stack[-1])
    if not tensor.requires_grad:
        return tensor
    return plain_alias(tensor)


def unpack(saved: Any) -> Any:
    return saved


# ----------------------------------------------------------------------- compiled graphs
class observe_compiled:
    """Told about each call of torch.compile'd code (tensorscope._compiled): its outputs are
    made by one op, the graph (see recorder.py's NOTE on first sight)."""

    @staticmethod
    def enter() -> None:
        rec = OPEN.get(threading.get_ident())
        if rec is not None:
            rec.compiled_depth += 1

    @staticmethod
    def exit(out: Any, args: tuple[Any, ...]) -> None:
        rec = OPEN.get(threading.get_ident())
        if rec is None:
            return
        rec.compiled_depth = max(0, rec.compiled_depth - 1)
        index = rec.n_ops
        rec.n_ops = index + 1
        _record_op(rec, index, "compiled graph", _PLAIN, _clock(), tuple(args), None, out)


skip_in_dynamo(
    recorder_here,
    _region,
    _use,
    _record_op,
    _mark_collective,
    name_nodes,
    _owner_index,
    _tag_update,
    pack,
    unpack,
    observe_compiled.enter,
    observe_compiled.exit,
    Recorder.watch,
    Recorder.first_sight,
    Recorder.mark,
    Recorder.new_high,
)
