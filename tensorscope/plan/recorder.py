"""The recorder's state while ``ts.record()`` is open: storages, ops, module calls.

# NOTE [storages, not tensors]
# A view, a ``detach()`` alias and the copy autograd keeps of a saved output are different
# tensors on one storage, and the bytes are the storage's: so the unit of a plan is the
# storage. Since torch 2.0 a storage's Python object lives as long as its ``StorageImpl`` (the
# object is preserved, like a tensor's), so a weak reference to ``t.untyped_storage()`` fires
# its callback exactly when the memory is released, whoever held it last (a Python variable,
# autograd's graph, an optimizer, the residency manager); ``id()`` of that object is a stable
# key while it lives. Measured: ``untyped_storage()`` 0.11 µs, a weak reference 0.3 µs.
#
# NOTE [first sight]
# A storage no op made during the step existed before it (parameters, buffers, the input batch,
# optimizer state, last step's gradients) and is alive from op 0, with one exception: what
# torch.compile'd code allocates without the dispatcher (its outputs, its saved tensors, the
# buffers its external kernels write into) is first seen after the graph made it, so inside a
# compiled call, in a backward (outside an optimizer step: optimizer-in-backward meets its state
# there), or in a saved-tensor hook a storage first seen counts as made by the latest op.
#
# NOTE [resized storages]
# ``storage.resize_()`` changes a storage's bytes without an op: the dispatcher never sees it
# (FSDP2 frees an unsharded parameter with ``resize_(0)`` after each use and gathers it into
# the same storage again). While a recording is open ``UntypedStorage.resize_`` is wrapped
# (hooks.py, as torch's ``MemTracker`` does), and each size a storage takes is one record of
# its own: a resize ends the storage's current record before the next op (as a free would)
# and, if it has bytes, begins another, made before the next op, that keeps what is known of
# it (its role, name, owner). A plan then shows each time FSDP2 gathered a parameter as one
# lifetime.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import torch

from tensorscope._sharded import local_tensor, shard_storages
from tensorscope._sites import Site
from tensorscope.plan.data import CallRecord, OpRecord, StepRecord, StorageRecord
from tensorscope.plan.sites import site_text

__all__ = ["FORWARD", "Recorder", "Watch"]

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
_ROLE_RANK = {
    "": 0,
    "buffer": 1,
    "optimizer_state": 2,
    "gradient": 3,
    "parameter": 4,
    "reduce_scatter": 5,
    "sharded_parameter": 6,
    "unsharded_parameter": 6,
}
_strided = torch.strided
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


class Watch(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to one storage's Python object, carrying what the recorder knows."""

    __slots__ = (
        "call",
        "created",
        "device",
        "dtype",
        "first_backward_use",
        "freed",
        "index",
        "key",
        "last_backward_use",
        "last_forward_use",
        "last_use",
        "managed",
        "name",
        "nbytes",
        "owner",
        "rec",
        "role",
        "saved",
        "saved_by",
        "shape",
        "site",
        "unseen",
    )

    rec: Recorder
    key: int
    index: int
    nbytes: int
    created: int
    freed: int | None
    last_use: int
    last_forward_use: int
    first_backward_use: int
    last_backward_use: int
    site: Site
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    role: str
    name: str
    owner: int
    saved: bool
    saved_by: tuple[int, ...]
    call: int
    managed: int  # the StorageImpl's address when the residency manager manages it, else 0
    unseen: bool  # first seen in a backward or compiled call, made by no op seen (NOTE [first ...])


def _released(watch: Watch) -> None:
    """The storage died: it was freed before the op about to begin."""
    rec = watch.rec
    if rec.open and watch.freed is None:  # not a record a resize ended (NOTE [resized ...])
        watch.freed = rec.n_ops
        if rec.live.get(watch.key) is watch:
            del rec.live[watch.key]
        rec.alive_bytes -= watch.nbytes


class Recorder:
    """What one ``ts.record()`` block saw, on the thread that opened it."""

    def __init__(self, tier_reader: Callable[[int], str | None] | None) -> None:
        self.open = True
        self.thread_id = threading.get_ident()
        self.n_ops = 0
        self.t0 = time.perf_counter()
        self.end_s = 0.0
        # (name, start_s, site, call, phase, forward_op) per op
        self.ops: list[tuple[str, float, Site, int, str, int]] = []
        self.live: dict[int, Watch] = {}
        self.watches: list[Watch] = []
        self.calls: list[CallRecord] = []
        self.stack: list[int] = []
        self.call_keys: dict[int, str] = {}  # id(module) -> path
        self.roots: list[int] = []  # id of each root module seen
        self.params: list[weakref.ref[torch.Tensor]] = []  # parameters of the modules that ran
        self.param_seen: set[int] = set()  # their storage indices
        self.module_calls: dict[int, list[int]] = {}  # id(module) -> its open calls
        self.optimizer_depth = 0
        self.optimizer_start = 0
        self.optimizer_steps: list[tuple[int, int]] = []
        self.gradient_readers: list[str] = []
        self.region_kinds: list[int] = []  # 2: an optimizer step, 1: zero_grad, 0: another
        self.compiled_depth = 0
        # (result, op) of forward ops whose results need grad: their nodes get the op's index
        self.pending_nodes: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self.alive_bytes = 0
        self.high_bytes = 0
        self.tier_reader = tier_reader
        self.tiers: dict[int, str] = {}  # storage index -> tier at the latest snapshot
        self.tier_changes: list[tuple[int, dict[int, str]]] = []
        self.sharded_roots: list[weakref.ref[torch.nn.Module]] = []  # FSDP2 models that ran

    # ----------------------------------------------------------------------------- storages
    def watch(self, tensor: torch.Tensor, created: int, site: Site = None) -> Watch | None:
        """The record of ``tensor``'s storage, made now if first seen (see the NOTE); a
        ``DTensor``'s is its local tensor's (NOTE [through DTensor], mode.py)."""
        if tensor.layout is not _strided:
            return None
        if type(tensor) is not _Tensor and type(tensor) is not _Parameter:
            tensor = local_tensor(tensor)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # torch.func's wrappers, fake tensors
            return None
        found = self.live.get(id(storage))
        if found is not None:
            return found
        return self.first_sight(tensor, storage, created, site)

    def first_sight(
        self, tensor: torch.Tensor, storage: torch.UntypedStorage, created: int, site: Site
    ) -> Watch:
        """A record for a storage seen for the first time (``created``: -1 if it existed before
        the step, unless it was seen where that cannot be: see the NOTE on first sight)."""
        unseen = created < 0 and (
            self.compiled_depth
            or (not self.optimizer_depth and torch._C._current_graph_task_id() != -1)
        )
        if unseen:
            created = max(self.n_ops - 1, 0)  # made unseen just now (see the NOTE)
        kind = type(tensor)
        parameter = kind is _Parameter or (kind is not _Tensor and isinstance(tensor, _Parameter))
        w = self._begin(
            storage,
            created,
            site,
            0 if tensor.is_meta else storage.nbytes(),
            tensor.shape,  # made text at close: the hot path keeps torch's own objects
            tensor.dtype,
            tensor.device,
            "parameter" if parameter else "",
        )
        w.unseen = bool(unseen)
        return w

    def _begin(
        self,
        storage: torch.UntypedStorage,
        created: int,
        site: Site,
        nbytes: int,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        role: str,
    ) -> Watch:
        w = Watch(storage, _released)
        w.rec = self
        w.key = id(storage)
        w.nbytes = nbytes
        w.created = created
        w.freed = None
        w.last_use = w.last_forward_use = w.first_backward_use = w.last_backward_use = -1
        w.site = site
        w.shape = shape
        w.dtype = dtype
        w.device = device
        w.role = role
        w.name = ""
        w.owner = -1
        w.saved = False
        w.saved_by = ()
        w.call = self.stack[-1] if self.stack else -1
        w.managed = 0
        w.unseen = False
        w.index = len(self.watches)
        self.watches.append(w)
        self.live[w.key] = w
        if self.tier_reader is not None:
            address = int(storage._cdata)
            if self.tier_reader(address) is not None:
                w.managed = address
        self.alive_bytes += nbytes
        if self.alive_bytes > self.high_bytes:
            self.new_high()
        return w

    def mark(self, tensor: torch.Tensor, role: str, owner: Watch | None, name: str = "") -> None:
        """Note what ``tensor``'s storage is (a parameter, a gradient, optimizer state...)."""
        w = self.watch(tensor, -1)
        if w is None:
            return
        if _ROLE_RANK[role] > _ROLE_RANK[w.role]:
            w.role = role
        if owner is not None and w.owner < 0 and owner is not w:
            w.owner = owner.index
        if name and not w.name:
            w.name = name

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage`` was resized from ``before`` bytes (NOTE [resized storages])."""
        key = id(storage)
        nbytes = storage.nbytes()
        w = self.live.get(key)
        if w is None and before:  # not seen yet: its bytes so far existed before the step
            shape = torch.Size([before])
            w = self._begin(storage, -1, None, before, shape, torch.uint8, storage.device, "")
        if w is not None and w.nbytes == nbytes:
            return
        if w is not None:
            w.freed = self.n_ops
            del self.live[key]
            self.alive_bytes -= w.nbytes
        if not nbytes:
            return
        if w is None:
            shape = torch.Size([nbytes])
            self._begin(storage, self.n_ops, None, nbytes, shape, torch.uint8, storage.device, "")
            return
        again = self._begin(storage, self.n_ops, w.site, nbytes, w.shape, w.dtype, w.device, w.role)
        again.name, again.owner, again.call = w.name, w.owner, w.call

    def new_high(self) -> None:
        """The step's bytes reached a new high: read the managed storages' tiers."""
        self.high_bytes = self.alive_bytes
        reader = self.tier_reader
        if reader is None:
            return
        changes: dict[int, str] = {}
        tiers = self.tiers
        for w in list(self.live.values()):  # frees may come from autograd's device threads
            if not w.managed:
                continue
            tier = reader(w.managed)
            if tier is not None and tiers.get(w.index) != tier:
                tiers[w.index] = changes[w.index] = tier
        if changes:
            self.tier_changes.append((max(self.n_ops - 1, 0), changes))

    # ------------------------------------------------------------------------ module calls
    def enter_call(self, path: str, inputs: tuple[int, ...], recompute: bool) -> int:
        index = len(self.calls)
        parent = self.stack[-1] if self.stack else -1
        start_s = time.perf_counter() - self.t0
        self.calls.append(CallRecord(path, self.n_ops, -1, start_s, 0.0, parent, inputs))
        self.calls[index].recompute = recompute
        self.stack.append(index)
        return index

    def exit_call(self, index: int, outputs: tuple[int, ...]) -> None:
        if index not in self.stack:
            return
        while self.stack and self.stack.pop() != index:
            pass  # a call that raised left its entries: drop them with it
        call = self.calls[index]
        call.end = self.n_ops
        call.end_s = time.perf_counter() - self.t0
        call.outputs = outputs

    # ------------------------------------------------------------------------------ closing
    def _sharded_roles(self) -> None:
        """What the FSDP2 models that ran hold (NOTE [what FSDP2 holds], _sharded.py): each
        record of those storages (every size they took) gets its role and parameter name."""
        roles: dict[int, tuple[str, str]] = {}
        for ref in self.sharded_roots:
            root = ref()
            if root is not None:
                roles.update(shard_storages(root))
        if not roles:
            return
        for w in self.watches:
            storage = w()
            found = roles.get(id(storage)) if storage is not None else None
            if found is not None:
                w.role, name = found
                w.name = name or w.name

    def close(self) -> StepRecord:
        """Stop recording and return what was seen as plain data (no torch state kept)."""
        self.open = False
        self.end_s = time.perf_counter() - self.t0
        if 2 in self.region_kinds:  # closed inside an optimizer step (its post-hook)
            self.optimizer_steps.append((self.optimizer_start, self.n_ops))
        for index in reversed(self.stack):  # calls still open (an exception): end them now
            self.calls[index].end = self.n_ops
            self.calls[index].end_s = self.end_s
        self._sharded_roles()
        texts: dict[object, int] = {None: 0}
        sites = [""]

        def site_index(site: Site) -> int:
            # By the code objects' ids (alive in self.ops): a code object need not be hashable
            # (torch.compile's resume functions hold dicts among their constants).
            key = None if site is None else tuple(x if type(x) is int else id(x) for x in site)
            found = texts.get(key)
            if found is None:
                found = texts[key] = len(sites)
                sites.append(site_text(site))
            return found

        ops = [
            OpRecord(name, start, site_index(site), call, phase, forward)
            for name, start, site, call, phase, forward in self.ops
        ]
        storages = [
            StorageRecord(
                nbytes=w.nbytes,
                created=w.created,
                freed=w.freed,
                last_use=w.last_use,
                last_forward_use=w.last_forward_use,
                first_backward_use=w.first_backward_use,
                last_backward_use=w.last_backward_use,
                site=site_index(w.site),
                shape=tuple(w.shape),
                dtype=str(w.dtype).removeprefix("torch."),
                device=str(w.device),
                role=w.role,
                name=w.name,
                owner=w.owner,
                saved=w.saved,
                saved_by=w.saved_by,
                call=w.call,
            )
            for w in self.watches
        ]
        record = StepRecord(
            ops=ops,
            storages=storages,
            calls=self.calls,
            sites=sites,
            optimizer_steps=self.optimizer_steps,
            gradient_readers=self.gradient_readers,
            seconds=self.end_s,
            tier_changes=self.tier_changes,
            module_ids=dict(self.call_keys),
        )
        self.watches = []
        self.live = {}
        self.params = []
        return record
