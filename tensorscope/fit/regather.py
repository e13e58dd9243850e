"""The chain's blocks sharded by FSDP2: a block recomputed outside its own backward gathers its
parameters for that, and lets them go after (NOTE [recomputing a sharded block]).

# NOTE [recomputing a sharded block]
# FSDP2 gathers a block's parameters in its forward pre-hook and frees them in its forward
# hook; before the block's backward (a hook on its outputs) it gathers them again, and frees
# them after its reduce-scatter. In the model's forward the chain's ops run inside the block's
# call, so FSDP2's hooks hold the parameters; the recomputation of block k's own forward just
# before B(k) runs after FSDP2's pre-backward gathered them. But rotor's schedule also
# recomputes earlier blocks inside B(k) (from a kept input j < k forward to k): block j's
# parameters are sharded then. Calling block j again (its ``__call__``) would re-enter FSDP2's
# pre-forward hook outside the forward: it would register another post-backward hook and
# append to FSDP2's forward order (its backward prefetch reads it). torchtitan composes with
# ``torch.utils.checkpoint`` by recomputing *inside* a block's own backward, where FSDP2's
# ``PRE_BACKWARD`` state makes the hooks gather only. Here the recomputation of block j runs
# in block k's backward, so the chain drives FSDP2's public ``unshard()``/``reshard()``
# instead (the chain's placer protocol, blockrun.py NOTE [placed parameters]): before an op
# of block j, its parameters are gathered if they are not (a collective: every rank runs the
# same schedule, NOTE [one decision across ranks]); after it, the ones gathered here are freed
# again. What Fe(j) saved for B(j) keeps the unsharded parameters' storages, which FSDP2
# refills in j's pre-backward (it frees and refills the same storages itself). So a
# recomputation costs one gather more (the decision counts it in the block's forward time),
# and holds one block's gathered parameters more while it runs (counted outside the chain).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from tensorscope._sharded import is_fsdp2, reshard, unshard, unsharded

__all__ = ["Regather", "sharded_blocks"]


def sharded_blocks(blocks: Sequence[nn.Module]) -> list[int]:
    """The indices of the blocks ``fully_shard`` was applied to."""
    return [k for k, block in enumerate(blocks) if is_fsdp2(block)]


class Regather:
    """The chain's placer (blockrun.Placer) for FSDP2-sharded blocks (NOTE [recomputing a
    sharded block]).

    Attributes:
        gathers: gathers this placer ran (each a collective).
    """

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self.blocks = tuple(blocks)
        self.sharded = frozenset(sharded_blocks(self.blocks))
        self.gathers = 0
        self._mine: set[int] = set()

    def use(self, k: int, write: bool = False) -> None:
        """Block ``k``'s parameters are about to be used: gathered, if FSDP2 does not hold
        them gathered now."""
        if k not in self.sharded or k in self._mine:
            return
        block = self.blocks[k]
        if unsharded(block):
            return
        unshard(block)
        self.gathers += 1
        self._mine.add(k)

    def done(self, k: int) -> None:
        """Block ``k``'s op is over: its parameters freed if gathered here."""
        if k in self._mine:
            self._mine.discard(k)
            reshard(self.blocks[k])

    def drop(self) -> None:
        """Free every block's parameters gathered here (an aborted step)."""
        for k in sorted(self._mine):
            self.done(k)
