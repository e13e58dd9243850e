"""The part of a fit that spans processes: under FSDP2 or DDP every rank fits its own model under
its own budget, and they agree before acting (NOTE [one decision across ranks], fit/agree.py;
NOTE [errors across ranks], fit/ranks.py).

# NOTE [a fit across ranks]
# FSDP2 and DDP are PyTorch's engines; ts.fit plans inside them. What this part adds:
# - one decision: the measurements every decision reads (the chain's profile and context, the
#   step outside the chain, the offload model, the budget, the reasons to keep gradients) are
#   gathered and merged into the slowest and largest before the pure decision runs, at the
#   measured step's end, the re-timed step's end and the step whose peak is checked; a choice
#   one rank cannot make (a tier that failed) is redecided on every rank at the next step's
#   start (the step's own agreement: its batch bytes, gradients left from before, a pending
#   redecision);
# - sharded blocks: the chain's placer gathers and frees a sharded block's parameters around
#   its recomputation (fit/regather.py), and the decision counts that gather: the time of each
#   block's FSDP2 pre-forward (its all-gather), measured by two hooks around it, is added to
#   the block's forward time, and one block's gathered parameters to what the step holds
#   outside the chain;
# - optimizer-in-backward under FSDP2: FSDP2 calls a sharded parameter's post-accumulate-grad
#   hooks after its reduce-scatter, so the update runs on the reduced shard's gradient (not
#   under HSDP, whose all-reduce comes after); under DDP gradients are kept. inbackward.py's
#   mechanism runs as on one process, a block's parameters updated together included (NOTE [a
#   block's parameters updated together]): FSDP2 reduces one group's (one block's) gradients
#   in one reduce-scatter and then calls its parameters' hooks one after another, so the
#   block's last hook finds all of its shards reduced (a 4-block GPT-2 on 2 gloo ranks:
#   bit-identical to plain FSDP2);
# - what is not built stays off, said in explain(): the chain's parameters are not placed in
#   files under FSDP2 or DDP (both own their parameters' storages).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tensorscope._sharded import fsdp2_modules, is_ddp, replicated_too, sharded_parameters
from tensorscope._units import format_bytes
from tensorscope.errors import InvalidArgumentError
from tensorscope.fit.agree import budget_note, common_bases, reasons_of, slowest
from tensorscope.fit.inbackward import parameters_of
from tensorscope.fit.parts import Part, Step
from tensorscope.fit.ranks import Ranks
from tensorscope.fit.regather import Regather, sharded_blocks

if TYPE_CHECKING:
    from tensorscope.checkpoint.blocks import CheckpointedChain
    from tensorscope.checkpoint.offloaded import OffloadModel
    from tensorscope.checkpoint.profile import Profile
    from tensorscope.fit.account import StepBase
    from tensorscope.fit.parts.place import ParamPlacement
    from tensorscope.fit.parts.states import OptimizerStates

__all__ = ["AcrossRanks", "Begun", "Departure"]

_SUB = "tensorscope.fit"


# NOTE [a rank that removes its fit]
# ``fit.remove()`` runs no collective (it must work on one rank, with the group gone, at
# exit). But the other ranks' fits agree at each step's start, and a rank without its fit would
# never join: they would wait. So a removed fit leaves one forward pre-hook on its model (a
# ``Departure``): at the model's next training forward it joins that step's agreement saying
# "removed", then goes. Every rank still fitted then removes its fit too (a FitWarning names
# the rank) before the step runs, and the step runs plain FSDP2/DDP on all of them. Where every
# rank removed its fit, their departures meet at the next training forward, and go. A rank
# that removes its fit while the others are still in their first three steps (whose ends agree
# too) is not supported: remove on every rank, or after step 3.


@dataclass(frozen=True)
class Begun:
    """A step's start, agreed (``AcrossRanks.begin``).

    Attributes:
        batch_nbytes: the largest batch of any rank (bytes of the first forward's inputs).
        grads: whether gradients existed when it began, on any rank.
        again: why the decision is taken again first (``""``: it is not).
        departed: whether a rank removed its fit (NOTE [a rank that removes its fit]).
    """

    batch_nbytes: int
    grads: bool
    again: str = ""
    departed: bool = False


class Departure:
    """A removed fit's goodbye (NOTE [a rank that removes its fit]): a forward pre-hook that
    joins the next step's agreement, then removes itself."""

    def __init__(self, model: nn.Module, ranks: Ranks) -> None:
        self.ranks = ranks
        self.handle: Any = model.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self.handle.remove()
        if torch.distributed.is_initialized():  # the group is gone: nobody waits
            self.ranks.most([0, 0, 0, 1])


class AcrossRanks(Part):
    """The agreement of a fit's ranks, and FSDP2's sharded blocks (NOTE [a fit across ranks]).

    Attributes:
        ranks: the group agreed in (None: one process; nothing here runs).
        engine: ``"FSDP2"``, ``"DDP"`` or ``""`` (neither found on the model).
        budgets: every rank's budget, as given to ``ts.fit`` (empty: not agreed at ts.fit).
        regather: the chain's placer for sharded blocks (None: no block is sharded).
        pending: why this rank wants the decision taken again at the next step's start.
    """

    def __init__(
        self,
        chain: CheckpointedChain | None,
        states: OptimizerStates,
        place: ParamPlacement,
        ranks: Ranks | None,
    ) -> None:
        self.chain = chain
        self.ranks = ranks
        self.budgets: tuple[int, ...] = ()
        self.engine = ""
        self.regather: Regather | None = None
        self.pending = ""
        self._states = states
        self._place = place
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._sharded_at_attach: frozenset[int] = frozenset()
        self.departed = False  # removed: by this rank, or because another rank removed its fit
        self._checked = False  # the order of fully_shard, the optimizer and ts.fit
        self._adopted = False  # the group looked for again at the first step
        self._hooks: list[Any] = []
        self._t0: dict[int, float] = {}
        self._gather_s: dict[int, float] = {}
        self._raw: Profile | None = None  # the agreed profile, without the gathers
        self._set: Profile | None = None  # what was set on the chain from it

    @property
    def active(self) -> bool:
        """Whether more than one rank takes part."""
        return self.ranks is not None

    # -- attach -----------------------------------------------------------------------------

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model, self._optimizer = model, optimizer
        sharded = fsdp2_modules(model)
        self._sharded_at_attach = frozenset(id(m) for m in sharded)
        if sharded:
            self.engine = "FSDP2"
        elif is_ddp(model) or self.ranks is not None:
            self.engine = "DDP" if is_ddp(model) else ""
        if self.ranks is not None or sharded:
            self._place.off = "the model's parameters belong to " + (
                "FSDP2 (sharded)" if sharded else "the distributed engine"
            )
        chain = self.chain
        if chain is not None and sharded:
            self.regather = Regather(chain.blocks)
            for k in sorted(self.regather.sharded):
                block = chain.blocks[k]
                self._hooks.append(
                    block.register_forward_pre_hook(self._before_gather(k), prepend=True)
                )
                self._hooks.append(block.register_forward_pre_hook(self._after_gather(k)))
        if chain is not None and self.ranks is not None:
            chain.retime_hook = self._retimed

    def detach(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()
        if self.chain is not None:
            self.chain.retime_hook = None
        if self.regather is not None:
            self.regather.drop()

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        if self.regather is not None:
            self.regather.drop()
        return ()

    def _before_gather(self, k: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self._t0[k] = time.perf_counter()

        return hook

    def _after_gather(self, k: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            start = self._t0.pop(k, None)
            if start is not None:
                took = time.perf_counter() - start
                self._gather_s[k] = min(self._gather_s.get(k, took), took)

        return hook

    # -- the step's agreement -----------------------------------------------------------------

    def begin(self, batch_nbytes: int, grads: bool) -> Begun:
        """A step begins on this rank: the structure checked, then agreed with the other ranks
        (the step's agreement, one small all-reduce): its batch bytes (the largest), whether
        gradients existed (on any rank), whether a rank wants the decision taken again, and
        whether a rank removed its fit (NOTE [a rank that removes its fit]).

        Raises:
            InvalidArgumentError: FSDP2 was applied after ts.fit, or the optimizer holds
                parameters FSDP2 replaced (the structure is every rank's: each raises it).
        """
        if not self._checked:
            self._check_order()
            self._checked = True
        if self.ranks is None and not self._adopted:  # a group initialized after ts.fit
            self._adopted = True
            self.ranks = Ranks.here()
            if self.ranks is not None:
                self._place.off = "the model's parameters belong to the distributed engine"
                if self.chain is not None:
                    self.chain.retime_hook = self._retimed
        ranks = self.ranks
        if ranks is None:
            return Begun(batch_nbytes, grads)
        wanted, self.pending = self.pending, ""
        most = ranks.most([batch_nbytes, int(grads), int(bool(wanted)), 0])
        again = (wanted or "a write to the next tier failed on another rank") if most[2] else ""
        return Begun(most[0], bool(most[1]), again, bool(most[3]))

    def depart(self, model: nn.Module) -> None:
        """This rank's fit is removed: the others are told at their next step's start
        (NOTE [a rank that removes its fit])."""
        ranks = self.ranks
        if ranks is not None and not self.departed:
            self.departed = True
            Departure(model, ranks)

    def _check_order(self) -> None:
        model, optimizer = self._model, self._optimizer
        if model is None or optimizer is None:
            return
        sharded = fsdp2_modules(model)
        if frozenset(id(m) for m in sharded) != self._sharded_at_attach:
            raise InvalidArgumentError(
                f"{_SUB}: fully_shard was applied to {type(model).__name__} after ts.fit; "
                f"the order is: fully_shard every block, then the model, then make the "
                f"optimizer, then ts.fit(model, optimizer, budget=...) (call fit.remove() "
                f"first to shard a fitted model)"
            )
        if sharded:
            owned = {id(p) for p in sharded_parameters(model)}
            plain = [p for p in parameters_of(optimizer) if id(p) not in owned]
            if plain:
                raise InvalidArgumentError(
                    f"{_SUB}: the optimizer holds {len(plain)} parameters that are not "
                    f"FSDP2's sharded ones: it was made before fully_shard. Make the "
                    f"optimizer after fully_shard (over model.parameters()), then ts.fit"
                )

    def want_again(self, why: str) -> None:
        """This rank needs the decision taken again (a write to the next tier failed): every
        rank takes it at the next step's start."""
        rank = self.ranks.rank if self.ranks is not None else 0
        self.pending = f"on rank {rank}: {why}"

    def all_applied(self, applied: bool) -> bool:
        """Whether every rank applied the decision (a part cannot apply it when a write to
        the next tier fails): then every rank decides again."""
        if self.ranks is None:
            return applied
        return not self.ranks.most([int(not applied)])[0]

    def most_excess(self, excess: int) -> int:
        """The largest measured excess over the budget of any rank (the step is checked on
        every rank at once)."""
        if self.ranks is None:
            return excess
        return self.ranks.most([max(excess, 0)])[0]

    # -- the decision's agreement ---------------------------------------------------------------

    def reasons(self, local: list[str]) -> list[str]:
        """Every rank's reasons to keep gradients, and the engine's own."""
        ranks = self.ranks
        own = list(local)
        if ranks is not None and self.engine != "FSDP2":
            own.append(
                f"a process group of {ranks.world} ranks is initialized and the model is not "
                f"sharded by FSDP2: DDP averages each gradient across ranks after autograd "
                f"accumulates all of a bucket, so an update at accumulation would use this "
                f"rank's gradient alone"
            )
        if self.engine == "FSDP2" and self._model is not None and replicated_too(self._model):
            own.append(
                "FSDP2 with a replicated dimension (HSDP): the shard's gradient is all-reduced "
                "across replicas after FSDP2 calls the update hooks"
            )
        if ranks is None:
            return own
        return reasons_of(ranks.agree(lambda: own))

    def inputs(
        self, budget: int, bases: list[StepBase], offload: OffloadModel | None
    ) -> tuple[int, list[StepBase], OffloadModel | None]:
        """The decision's inputs, agreed (NOTE [one decision across ranks]): the budget (the
        smallest), the ways of running the step outside the chain, the chain's profile and
        context (set on the chain), the offload model. Under FSDP2 each base holds one block's
        gathered parameters more (NOTE [recomputing a sharded block])."""
        chain = self.chain
        profile = chain.profile if chain is not None else None
        raw = self._raw if profile is not None and profile is self._set else profile
        context = chain.context_nbytes if chain is not None else 0
        reserved = chain.reserved_nbytes if chain is not None else 0
        mine = (budget, bases, raw, context, reserved, offload, self._gathers())
        ranks = self.ranks
        every = ranks.agree(lambda: mine) if ranks is not None else [mine]
        budget = min(e[0] for e in every)
        bases = common_bases([e[1] for e in every])
        agreed = slowest([e[2] for e in every]) if raw is not None else None
        if chain is not None and agreed is not None:
            self._raw = agreed
            chain.context_nbytes = max(e[3] for e in every)
            chain.reserved_nbytes = max(e[4] for e in every)
            self._set = chain.profile = self._with_gathers(agreed, [e[6] for e in every])
        offload = slowest([e[5] for e in every])
        extra = self._gathered_nbytes()
        if extra:
            bases = [dataclasses.replace(b, under_chain=b.under_chain + extra) for b in bases]
        return budget, bases, offload

    def _retimed(self, profile: Profile) -> Profile:
        """The chain was re-timed (NOTE [retiming], checkpoint/blocks.py): agreed too."""
        ranks = self.ranks
        mine = (profile, self._gathers())
        every = ranks.agree(lambda: mine) if ranks is not None else [mine]
        self._raw = slowest([e[0] for e in every])
        self._set = self._with_gathers(self._raw, [e[1] for e in every])
        return self._set

    def _gathers(self) -> tuple[float, ...]:
        n = len(self.chain.blocks) if self.chain is not None else 0
        return tuple(self._gather_s.get(k, 0.0) for k in range(n))

    def _with_gathers(self, profile: Profile, every: list[tuple[float, ...]]) -> Profile:
        """Each block's forward time with its gather added (a recomputation gathers again)."""
        gathers = slowest(every) if every else ()
        if not any(gathers):
            return profile
        layers = tuple(
            dataclasses.replace(p, fw_s=p.fw_s + g)
            for p, g in zip(profile.layers, gathers, strict=True)
        )
        return dataclasses.replace(profile, layers=layers)

    def _gathered_nbytes(self) -> int:
        """Bytes one recomputed sharded block holds gathered while it runs: its parameters
        and, while the gather copies out, the flat buffer of the same size."""
        chain, regather = self.chain, self.regather
        if chain is None or regather is None or not regather.sharded:
            return 0
        sizes = [
            sum(p.numel() * p.element_size() for p in chain.blocks[k].parameters())
            for k in regather.sharded
        ]
        return 2 * max(sizes)

    # -- explain ------------------------------------------------------------------------------

    def lines(self) -> list[str]:
        """What ``explain()`` says of the ranks."""
        ranks = self.ranks
        if ranks is None and not self.engine:
            return []
        engine = self.engine or "no FSDP2 or DDP found on the model"
        if ranks is None:
            return [f"across processes: {engine}, one rank"]
        out = [
            f"across processes: rank {ranks.rank} of {ranks.world} ({ranks.backend}), {engine}; "
            f"the budget is this rank's bytes; every rank decides from the measurements of "
            f"all of them (the slowest and largest), so all run one schedule"
        ]
        note = budget_note(list(self.budgets), format_bytes)
        if note:
            out.append(note)
        if self.regather is not None:
            out.append(
                f"sharded blocks: {len(self.regather.sharded)}; a block recomputed outside "
                f"its own backward gathers its parameters for that "
                f"({self.regather.gathers} such gathers so far)"
            )
        return out


def sharded_chain(chain: CheckpointedChain | None) -> bool:
    """Whether any of the chain's blocks is sharded by FSDP2."""
    return chain is not None and bool(sharded_blocks(chain.blocks))
