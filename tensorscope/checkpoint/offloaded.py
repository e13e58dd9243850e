"""Offloaded blocks in rotor's memory model (pure: plain data, no torch).

A block whose saved tensors go to the next tier after its forward (``ts.fit``'s activation
offload, ``fit/offload.py``) runs as rotor's ``Fe`` -- no recomputation -- but keeps in memory
only what is not offloaded: its output and the saved tensors too small (or not its own) to move.
See NOTE [offload in rotor's model].
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from tensorscope.checkpoint.chain import Chain, Schedule, forward_runs

__all__ = [
    "OFFLOAD_MIN_BYTES",
    "OffloadModel",
    "kept_offloaded",
    "offload_prefixes",
    "offload_window",
    "offloaded_chain",
    "predicted_io_s",
    "with_offload",
]

#: Saved storages smaller than this stay in memory when ``ts.fit`` offloads a block (their
#: per-tensor cost outweighs the bytes); the block probe measures with the same threshold.
OFFLOAD_MIN_BYTES = 256 << 10

# NOTE [offload in rotor's model]
# For an offloaded block k, xbar[k+1] shrinks by the bytes its forward saves that the offloader
# moves (measured per block in the measuring step: saved storages the block made, not
# parameter-like, at least the offloader's min_bytes), never below x[k+1]; rotor's DP then sees
# storing it as nearly free and keeps it (Fe) unless recomputing is still cheaper. What the
# shrunken xbar does not cover is reserved on top of the chain's limit, once: the bytes back in
# memory around B(k) -- block k's (read back for its backward) and block k-1's (prefetched
# then) -- and, in the forward, the bytes packed and not yet written (the offloader's in-flight
# bound, set to the largest block's bytes, so at most that). The reserve is the largest of
# these over the offloaded blocks; a sum of maxima, so the prediction never undercounts.
# Which blocks: a prefix 0..j-1 (the earliest blocks' activations wait longest for their
# backward, so their writes and reads have the most time to overlap compute), j chosen among
# a few values by predicted time (fit/decide.py); rotor decides the rest of the chain.


@dataclass(frozen=True)
class OffloadModel:
    """What offloading each block of a chain takes out of memory, and what it costs.

    Attributes:
        nbytes: per block, the bytes its forward saves that the offloader moves.
        seconds: per block, predicted seconds to write those bytes and read them back.
    """

    nbytes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.nbytes) != len(self.seconds):
            raise ValueError("OffloadModel: nbytes and seconds need one entry per block")

    @property
    def in_flight_nbytes(self) -> int:
        """The offloader's bound on packed, unwritten bytes: the largest block's."""
        return max(self.nbytes, default=0)

    def worth(self, k: int) -> bool:
        """Whether offloading block ``k`` moves anything."""
        return self.nbytes[k] > 0


def offloaded_chain(chain: Chain, model: OffloadModel, blocks: Collection[int]) -> Chain:
    """``chain`` with each block in ``blocks`` keeping only what is not offloaded.

    Example:
        >>> chain = Chain([1.0] * 3, [2.0] * 3, [10] * 4, [0] + [50] * 3, [0] * 3, [0] * 3)
        >>> model = OffloadModel((30, 30, 30), (0.1, 0.1, 0.1))
        >>> offloaded_chain(chain, model, {0, 2}).xbar_sizes
        (0, 20, 50, 20)
    """
    xbar, xsel = list(chain.xbar_sizes), list(chain.xsel_sizes)
    for k in blocks:
        xbar[k + 1] = xsel[k + 1] = max(chain.x_sizes[k + 1], xbar[k + 1] - model.nbytes[k])
    return Chain(
        chain.fw,
        chain.bw,
        chain.x_sizes,
        xbar,
        chain.fw_tmp,
        chain.bw_tmp,
        chain.loss_tmp,
        keeps_output=chain.keeps_output,
        xsel_sizes=xsel,  # an offloaded block runs Fe (its saved tensors are what moves)
        sel_bw=chain.sel_bw,
        sel_bw_tmp=chain.sel_bw_tmp,
    )


def offload_window(model: OffloadModel, blocks: Collection[int]) -> int:
    """Bytes reserved on top of the chain's limit for ``blocks`` offloaded (NOTE [offload in
    rotor's model]): the most back in memory around one backward, or packed and unwritten.

    Example:
        >>> offload_window(OffloadModel((30, 40, 5), (0.1,) * 3), {0, 1})
        70
        >>> offload_window(OffloadModel((30, 40, 5), (0.1,) * 3), {2})
        40
    """
    chosen = set(blocks)
    if not chosen:
        return 0
    pairs = [model.nbytes[k] + (model.nbytes[k - 1] if k - 1 in chosen else 0) for k in chosen]
    return max(max(pairs), model.in_flight_nbytes)


def with_offload(
    chain: Chain, model: OffloadModel | None, blocks: Collection[int]
) -> tuple[Chain, int]:
    """``chain`` as offloading ``blocks`` leaves it, and the bytes to reserve for that on top
    of its limit (``chain`` and 0 when nothing is offloaded)."""
    if model is None or not blocks:
        return chain, 0
    return offloaded_chain(chain, model, blocks), offload_window(model, blocks)


def kept_offloaded(
    blocks: Sequence[int], solve: Callable[[tuple[int, ...]], Schedule | None]
) -> tuple[Schedule | None, tuple[int, ...]]:
    """``solve`` with ``blocks`` offloaded; a block its schedule still recomputes is not
    offloaded, so it is dropped and the chain solved again (the set only shrinks). Returns the
    schedule (None: ``solve`` found none) and the blocks offloaded in it.

    Example:
        >>> from tensorscope.checkpoint.chain import Schedule
        >>> def solve(blocks):  # block 1 is recomputed whatever is offloaded
        ...     return Schedule(0.0, 0, (("Fe", 0), ("Fck", 1), ("Loss",), ("Fe", 1),
        ...                              ("B", 1), ("B", 0)), 0)
        >>> kept_offloaded([0, 1], solve)[1]
        (0,)
    """
    chosen = tuple(blocks)
    while True:
        schedule = solve(chosen)
        if schedule is None:
            return None, chosen
        runs = forward_runs(schedule.ops)
        kept = tuple(k for k in chosen if runs[k] == 1)
        if kept == chosen:
            return schedule, chosen
        chosen = kept


def offload_prefixes(n: int, model: OffloadModel) -> list[int]:
    """The prefix lengths ``j`` tried (blocks ``0..j-1`` offloaded): none, a third, two
    thirds, all -- the DP runs once per value, so the list is kept short.

    Example:
        >>> offload_prefixes(12, OffloadModel((1,) * 12, (0.0,) * 12))
        [4, 8, 12]
        >>> offload_prefixes(3, OffloadModel((0, 0, 0), (0.0,) * 3))
        []
    """
    if not any(model.worth(k) for k in range(n)):
        return []
    return sorted({max(1, -(-n * i // 3)) for i in (1, 2, 3)})


def predicted_io_s(model: OffloadModel, blocks: Sequence[int]) -> float:
    """Seconds the offload of ``blocks`` adds (their writes and reads, none assumed hidden
    behind compute: conservative)."""
    return sum(model.seconds[k] for k in blocks)
