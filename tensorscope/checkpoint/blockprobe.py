"""Measure a block chain during a real training step: sizes, transients and times per block.

The first training step of a checkpointed chain runs the "every block" schedule (each block's
input kept, each block recomputed with autograd just before its backward, like HF's gradient
checkpointing) with a :class:`BlockProbe` attached: every block op runs in a window where the
storages it allocates are counted (``StorageTracker`` on CPU, CUDA's allocator statistics on
CUDA) and its time is taken. See NOTE [measuring blocks in the first step].
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from tensorscope._torch import is_parameter_like
from tensorscope.checkpoint.calls import storage_key
from tensorscope.checkpoint.chain import Op
from tensorscope.checkpoint.offloaded import OFFLOAD_MIN_BYTES
from tensorscope.checkpoint.profile import LayerProfile, Meter, Profile
from tensorscope.checkpoint.selective import SelectiveMeter

__all__ = ["BlockProbe", "alike_medians", "every_block_ops", "retimed"]

# NOTE [measuring blocks in the first step]
# The chain's values are measured where the model really produces them, with the model's own
# context (masks, position embeddings, per-block arguments), so nothing is run twice just to
# measure, and the step fits whatever HF's checkpointing of every block fits:
#   Fck(k), forward:   x_nbytes (the output's storage, or more if the block left more
#                      allocated), the no-grad forward's transient, uses_rng (the CPU/CUDA
#                      random state moved).
#   Fe(k), backward:   xbar_nbytes (bytes left allocated with the output held: output plus new
#                      saved tensors), the transient, keeps_output (a saved tensor shares the
#                      output's storage), fw_s.
#   B(k):              bw_tmp (peak above the start, less the input gradient, not counting the
#                      parameter gradients), bw_s.
# These are NOTE [what is measured] in profile.py, taken inside the step. Times include the
# tracker's per-op cost (microseconds per op; blocks run milliseconds), once per block: a
# busy machine makes them noisy, which moves the choice between equal-cost schedules only.
# The tracker is pushed and popped inside each window -- never across the user's code,
# whose own dispatch modes (ts.record, ts.manage) must find the mode stack as they left it.


# NOTE [one timing per block]
# Each block is timed once (its Fe and its B in the measuring step), on a machine that may be
# busy: single runs of identical blocks were seen to differ by 10x here (a GC pass, another
# process, first-use costs in the first backward). Blocks of one class whose measured sizes
# are equal do the same work, so each gets the median time of its group: one outlier no
# longer makes the solver treat one block as special. Blocks that differ keep their own time.


def alike_medians(
    keys: Sequence[Hashable], times: Sequence[float], given: Mapping[int, float] | None = None
) -> list[float]:
    """Each time replaced by the median of the times whose key is equal (NOTE [one timing
    per block]); where ``given`` has new times (by index) for some of a group, the median of
    those instead (NOTE [retiming]: a block left out of a re-timing takes its alike blocks').

    Example:
        >>> alike_medians(["a", "a", "a", "b"], [1.0, 9.0, 2.0, 5.0])
        [2.0, 2.0, 2.0, 5.0]
        >>> alike_medians(["a", "a", "a", "b"], [1.0, 9.0, 2.0, 5.0], {0: 3.0, 1: 5.0})
        [4.0, 4.0, 4.0, 5.0]
    """
    new = given or {}
    groups: dict[Hashable, list[int]] = {}
    for k, key in enumerate(keys):
        groups.setdefault(key, []).append(k)
    out = list(times)
    for members in groups.values():
        mid = statistics.median(
            [new[k] for k in members if k in new] or [times[k] for k in members]
        )
        for k in members:
            out[k] = mid
    return out


def alike_key(p: LayerProfile) -> Hashable:
    """What makes two measured blocks alike: their class name and every measured size."""
    return (p.name, p.x_nbytes, p.xbar_nbytes, p.fw_tmp_nbytes, p.bw_tmp_nbytes, p.uses_rng)


def retimed(
    profile: Profile,
    fw_s: Mapping[int, float] | None = None,
    bw_s: Mapping[int, float] | None = None,
    sel_share: Mapping[int, float] | None = None,
) -> Profile:
    """``profile`` with the times given (by block index), then each time the median of its
    alike blocks' -- of the given ones where any of them was given: a block left out (one whose
    run was not pure compute, such as an offloaded block's, whose forward wrote its saved
    tensors out) takes its alike blocks' new times, not its old one. ``sel_share``: replays'
    measured shares of their forwards (NOTE [selective recomputation]), the same way.

    Example:
        >>> prof = Profile(4, (LayerProfile("B", 1.0, 2.0, 4, 8, 0, 0),) * 3, "cpu")
        >>> [p.fw_s for p in retimed(prof, {0: 3.0, 1: 5.0}).layers]
        [4.0, 4.0, 4.0]
    """
    keys = [alike_key(p) for p in profile.layers]
    fw = alike_medians(keys, [p.fw_s for p in profile.layers], fw_s)
    bw = alike_medians(keys, [p.bw_s for p in profile.layers], bw_s)
    share = alike_medians(keys, [p.sel_share for p in profile.layers], sel_share)
    layers = tuple(
        dataclasses.replace(p, fw_s=fw[k], bw_s=bw[k], sel_share=share[k])
        for k, p in enumerate(profile.layers)
    )
    return dataclasses.replace(profile, layers=layers)


def every_block_ops(n: int) -> list[Op]:
    """The schedule that checkpoints every block's input and recomputes each block once.

    Example:
        >>> every_block_ops(2)
        [('Fck', 0), ('Fck', 1), ('Loss',), ('Fe', 1), ('B', 1), ('Fe', 0), ('B', 0)]
    """
    ops: list[Op] = [("Fck", k) for k in range(n)]
    ops.append(("Loss",))
    for k in range(n - 1, -1, -1):
        ops += [("Fe", k), ("B", k)]
    return ops


@dataclass
class _Block:
    x_nbytes: int = 0
    xbar_nbytes: int = 0
    fw_tmp_nbytes: int = 0
    bw_tmp_nbytes: int = 0
    uses_rng: bool = False
    keeps_output: bool = True
    fw_s: float = 0.0
    bw_s: float = 0.0
    offload_nbytes: int = 0
    offload_tensors: int = 0
    sel_nbytes: int = 0
    sel_covered: int = 0
    sel_share: float = 1.0


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


class BlockProbe:
    """Per-block measurements of one run of the every-block schedule (see the module NOTE).

    Example:
        >>> probe = BlockProbe(1, torch.device("cpu"))
        >>> with probe.forward("Fck", 0) as seen:
        ...     y = torch.ones(256) * 2            # 1 KiB output, 1 KiB temporary
        ...     seen(y)
        >>> probe.blocks[0].x_nbytes, probe.blocks[0].fw_tmp_nbytes
        (1024, 1024)
        >>> probe.close()
    """

    def __init__(self, n: int, device: torch.device, *, selective: bool = False) -> None:
        self.device = device
        self.meter = Meter(device)
        self.blocks = [_Block() for _ in range(n)]
        self.selective = selective  # measure what Fs would keep (NOTE [selective recomputation])

    def _now(self) -> float:
        if self.meter.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def forward(self, kind: str, k: int) -> Iterator[Callable[[torch.Tensor], None]]:
        """Window around block ``k``'s forward op ``kind``; call ``seen(hidden)`` while the
        block's output is still held."""
        rec = self.blocks[k]
        saved: set[int] = set()
        movable: dict[int, int] = {}  # NOTE [offload in rotor's model]: key -> bytes
        live = [0, 0]  # bytes left allocated, output storage key

        def seen(hidden: torch.Tensor) -> None:
            live[0] = max(self.meter.live() - base, int(hidden.untyped_storage().nbytes()))
            live[1] = storage_key(hidden)

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_key(t)
            saved.add(key)
            if sel is not None:
                sel.saved(t)
            nbytes = int(t.untyped_storage().nbytes())
            if nbytes >= OFFLOAD_MIN_BYTES and not is_parameter_like(t):
                movable[key] = nbytes
            return t

        sync = (lambda: torch.cuda.synchronize(self.device)) if self.meter.cuda else None
        sel = SelectiveMeter(sync) if kind == "Fe" and self.selective else None
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            if kind == "Fe"
            else nullcontext()
        )
        rng_before = _rng_state(self.device) if kind != "Fe" else []
        # sel below the tracker's mode (entered first): it times the ops, not the tracking
        with sel if sel is not None else nullcontext(), self.meter.tracking():
            base = self.meter.mark()
            serial = self.meter.serial()
            start = self._now()
            with hooks:
                yield seen
            elapsed = self._now() - start
            tmp = max(0, self.meter.peak() - base - live[0])
            made = [  # the output stays: the next block's input
                n
                for key, n in movable.items()
                if key != live[1] and self.meter.made_since(serial, key)
            ]
        if kind == "Fe":
            rec.xbar_nbytes = max(live[0], rec.x_nbytes)
            rec.keeps_output = live[1] in saved
            rec.fw_s = elapsed
            rec.offload_nbytes = min(sum(made), max(0, rec.xbar_nbytes - rec.x_nbytes))
            rec.offload_tensors = len(made)
            if sel is not None:
                rec.sel_nbytes = sel.kept_nbytes - sel.forget(live[1])
                rec.sel_covered = sel.covered_nbytes
                rec.sel_share = sel.replay_share
        else:
            rec.x_nbytes = live[0]
            rec.uses_rng = not all(map(torch.equal, rng_before, _rng_state(self.device)))
            rec.fw_s = rec.fw_s or elapsed
        rec.fw_tmp_nbytes = max(rec.fw_tmp_nbytes, tmp)

    @contextmanager
    def backward(self, k: int) -> Iterator[Callable[..., None]]:
        """Window around ``B(k)``; call ``seen(input_grad, param_grads)`` before it ends."""
        rec = self.blocks[k]
        grads: list[torch.Tensor] = []
        input_nbytes = [0]

        def seen(input_grad: torch.Tensor | None, param_grads: Sequence[torch.Tensor]) -> None:
            grads.extend(param_grads)
            input_nbytes[0] = 0 if input_grad is None else input_grad.nbytes

        with self.meter.tracking():
            base = self.meter.mark()
            start = self._now()
            yield seen
            rec.bw_s = self._now() - start
            rec.bw_tmp_nbytes = max(0, self.meter.peak(grads) - base - input_nbytes[0])

    def profile(self, names: Sequence[str], input_nbytes: int) -> Profile:
        """The measurements as a :class:`~tensorscope.checkpoint.profile.Profile`; times are
        the medians of blocks alike (NOTE [one timing per block])."""
        layers = tuple(
            LayerProfile(
                name,
                b.fw_s,
                b.bw_s,
                b.x_nbytes,
                max(b.xbar_nbytes, b.x_nbytes),
                b.fw_tmp_nbytes,
                b.bw_tmp_nbytes,
                b.uses_rng,
                b.keeps_output,
                b.offload_nbytes,
                b.offload_tensors,
                b.sel_nbytes,
                b.sel_covered,
                b.sel_share,
            )
            for name, b in zip(names, self.blocks, strict=True)
        )
        return retimed(Profile(input_nbytes, layers, str(self.device)))

    def close(self) -> None:
        """Stop watching the storages still alive."""
        self.meter.close()
