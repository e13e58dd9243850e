"""Replay a schedule op by op: its exact time and peak memory, or why it is invalid.

Pure Python, no torch. This is the ground truth the solver is tested against: the dynamic
program in :mod:`tensorscope.checkpoint.solver` must agree with it exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tensorscope.checkpoint.chain import Chain, Op
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["Simulation", "Simulator", "simulate"]

# NOTE [memory model]
# What is alive while a chain trains, derived from what PyTorch allocates (docs/checkpoint.md
# has the long version). Three kinds of values exist, each with a size:
#   x[k]     a plain activation (computed without autograd, or the chain input x[0]): x_sizes[k].
#   xbar[k]  what layer k-1 left allocated after running with autograd, xbar_sizes[k]: its
#            output x_k -- the value ("out", k), x_sizes[k] -- plus the tensors it saved for
#            backward that did not exist before -- ("saved", k), the rest (a saved *input* is
#            x_{k-1}, already counted; parameters are excluded).
#   d[k]     the gradient w.r.t. x_k: x_sizes[k] (same shape and dtype as x_k).
# Each op's peak is (everything alive before it) + (what it creates) + (its transient):
#   Fn(k)   creates x[k+1], + fw_tmp[k]; then frees the plain x[k] (an x_k that is the output
#           of Fe(k-1) stays; Fn(0) is refused: the caller owns the chain input).
#   Fck(k)  the same but keeps x[k] (a checkpoint).
#   Fe(k)   creates xbar[k+1], + fw_tmp[k]; keeps its input (backward needs it).
#   Loss    reads x_L, creates d[L], + loss_tmp; then frees x_L (see below).
#   B(k)    reads xbar[k+1], d[k+1] and x_k; creates d[k], + bw_tmp[k]; then frees xbar[k+1],
#           d[k+1] and x_k (below; k > 0): nothing after B(k) needs them -- except d[L]:
#           autograd holds the chain output's gradient as the incoming gradient of the
#           executor's Function until that backward returns, so d[L] stays alive to the end.
# Freeing x_k: a plain x_k goes at B(k) (or at Loss, k = L). The output of Fe(k-1) goes with
# it too unless layer k-1's autograd state holds its own output (chain.keeps_output[k-1]: ReLU
# saves its result, Linear does not); then it goes at B(k-1) with the rest of xbar[k]. An
# output nobody will read (Fe(k-1) after B(k) or the loss ran) is freed as soon as it is made.
# With keeps_output all True this is rotor's model: xbar[k+1] lives from Fe(k) to B(k).
# NOTE [selective recomputation]
#   Fs(k)   runs layer k without autograd, keeping its output x_{k+1} and the results of its
#           expensive ops (matrix products, random draws) -- ("sel", k+1), xsel[k+1] in all --,
#           + fw_tmp[k]; keeps its input. B(k) after it first replays the forward with
#           autograd, the kept results standing in for those ops, so only the cheap ops run
#           again (+ sel_bw[k] seconds): its transient is sel_bw_tmp[k] (the replay's saved
#           tensors and output, and bw_tmp[k]) on top of what is alive. No autograd state holds
#           Fs(k)'s output, so it is freed with x_{k+1} as when layer k does not keep its output.
#           Chosen per layer by the DP where it pays: torch's selective activation checkpointing
#           with the policy "keep matmuls and random draws", priced by rotor's table.
# The chain input x[0] is alive throughout (mem_limit includes it). Time is the sum of fw[k]
# over forward ops plus bw[k] over B ops. Validity rules: an op needs its inputs alive; a value
# is never computed while it is already available (no duplicate x_k); no forward of layer k
# after B(k); the loss runs once; a complete schedule ends with d[0] computed.


@dataclass(frozen=True)
class Simulation:
    """Result of :func:`simulate`.

    Attributes:
        time: sum of the forward and backward times of the ops, in seconds.
        peak: highest memory reached during any op (same unit as the chain's sizes).
        op_peaks: the peak during each op, in order.

    Example:
        >>> chain = Chain([1], [2], [4, 4], [0, 8], [0], [0])
        >>> sim = simulate(chain, [("Fe", 0), ("Loss",), ("B", 0)])
        >>> sim.time, sim.peak, sim.op_peaks
        (3.0, 20, (12, 16, 20))
    """

    time: float
    peak: int
    op_peaks: tuple[int, ...]


class Simulator:
    """Step-by-step replay of ops on a chain (used by :func:`simulate` and brute-force search).

    The state is the set of alive values: ``("x", k)``, ``("out", k)``, ``("saved", k)``,
    ``("d", k)``.

    Example:
        >>> sim = Simulator(Chain([1], [1], [4, 4], [0, 8], [0], [0]))
        >>> sim.step(("Fe", 0))
        12
        >>> sim.alive_nbytes
        12
    """

    def __init__(self, chain: Chain, *, persistent: bool = False) -> None:
        self.chain = chain
        self.persistent = persistent
        self.checkpoints: set[int] = set()
        self.alive: dict[tuple[str, int], int] = {("x", 0): chain.x_sizes[0]}
        self.alive_nbytes = chain.x_sizes[0]
        self.time = 0.0
        self.peak = chain.x_sizes[0]
        self.loss_done = False
        self.backward_done: set[int] = set()
        self._index = 0

    def available(self, k: int) -> bool:
        """Whether activation ``x_k`` can be read (plain, or as the output of ``Fe(k - 1)``)."""
        return ("x", k) in self.alive or ("out", k) in self.alive

    @property
    def complete(self) -> bool:
        """Whether the gradient w.r.t. the chain input has been computed."""
        return ("d", 0) in self.alive

    def state(self) -> frozenset[tuple[str, int]]:
        """The alive values (and, if persistent, the checkpoints): all that decides the rest."""
        return frozenset(self.alive).union(("ck", k) for k in self.checkpoints)

    def _fail(self, op: Op, why: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"tensorscope.checkpoint: invalid schedule: op #{self._index} {op!r} {why}"
        )

    def _add(self, key: tuple[str, int], nbytes: int) -> None:
        self.alive[key] = nbytes
        self.alive_nbytes += nbytes

    def _drop(self, key: tuple[str, int]) -> None:
        nbytes = self.alive.pop(key, None)
        if nbytes is not None:
            self.alive_nbytes -= nbytes

    def _drop_x(self, k: int) -> None:
        """x_k is no longer needed: free it unless autograd state holds it (see the NOTE)."""
        self._drop(("x", k))
        # Fs(k-1)'s output: no autograd state holds it (its kept results are ("sel", k))
        if k > 0 and (not self.chain.keeps_output[k - 1] or ("sel", k) in self.alive):
            self._drop(("out", k))

    def check(self, op: Op) -> int:
        """Validate ``op`` in the current state and return its peak, without applying it.

        Raises:
            InvalidArgumentError: the op is malformed or reads a value that is not alive.
        """
        c = self.chain
        n = c.length
        kind = op[0] if isinstance(op, tuple) and op else None
        if kind == "Loss" and len(op) == 1:
            if self.loss_done:
                raise self._fail(op, "runs the loss a second time")
            if not self.available(n):
                raise self._fail(op, f"needs the chain output x_{n}, which is not alive")
            return self.alive_nbytes + c.x_sizes[n] + c.loss_tmp
        if kind not in ("Fn", "Fck", "Fe", "Fs", "B") or len(op) != 2:
            raise self._fail(
                op, "is not one of ('Fn', k) ('Fck', k) ('Fe', k) ('Fs', k) ('Loss',) ('B', k)"
            )
        k = op[1]
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
            raise self._fail(op, f"names layer {k!r}; layers are 0..{n - 1}")
        if not self.available(k):
            raise self._fail(op, f"needs x_{k}, which is not alive")
        if kind == "B":
            if ("d", k + 1) not in self.alive:
                raise self._fail(op, f"needs the gradient d_{k + 1}, which is not alive")
            if ("saved", k + 1) not in self.alive and ("sel", k + 1) not in self.alive:
                raise self._fail(op, f"needs the autograd state of layer {k} (run Fe({k}) first)")
            tmp = c.sel_bw_tmp[k] if ("sel", k + 1) in self.alive else c.bw_tmp[k]
            return self.alive_nbytes + c.x_sizes[k] + tmp
        if k in self.backward_done:
            raise self._fail(op, f"recomputes layer {k} after its backward")
        if self.available(k + 1):
            raise self._fail(op, f"computes x_{k + 1}, which is already alive")
        if kind == "Fn" and k == 0:
            raise self._fail(op, "would drop the chain input, which the caller owns; use Fck")
        if kind == "Fn" and k in self.checkpoints:
            raise self._fail(op, f"drops checkpoint x_{k} before B({k}) (not persistent)")
        if ("saved", k + 1) in self.alive or ("sel", k + 1) in self.alive:
            raise self._fail(op, f"runs layer {k} again while its autograd state is alive")
        if kind == "Fs" and not c.selective(k):
            raise self._fail(op, f"but layer {k} keeps no less with Fs than with Fe")
        sizes = {"Fe": c.xbar_sizes, "Fs": c.xsel_sizes}.get(kind, c.x_sizes)
        created = sizes[k + 1]
        return self.alive_nbytes + created + c.fw_tmp[k]

    def step(self, op: Op) -> int:
        """Apply ``op``; return its peak.

        Raises:
            InvalidArgumentError: see :meth:`check`.
        """
        peak = self.check(op)
        c = self.chain
        if op[0] == "Loss":
            n = c.length
            self._add(("d", n), c.x_sizes[n])
            self._drop_x(n)
            self.loss_done = True
        else:
            kind, k = op  # type: ignore[misc]
            if kind == "B":
                self.time += c.bw[k] + (c.sel_bw[k] if ("sel", k + 1) in self.alive else 0.0)
                self._add(("d", k), c.x_sizes[k])
                self._drop(("saved", k + 1))
                self._drop(("sel", k + 1))
                self._drop(("out", k + 1))
                if k + 1 < c.length:
                    self._drop(("d", k + 1))
                if k > 0:
                    self._drop_x(k)
                self.backward_done.add(k)
                self.checkpoints.discard(k)
            else:
                self.time += c.fw[k]
                if kind in ("Fe", "Fs"):
                    out = c.x_sizes[k + 1]
                    if kind == "Fe":
                        self._add(("saved", k + 1), c.xbar_sizes[k + 1] - out)
                    else:
                        self._add(("sel", k + 1), c.xsel_sizes[k + 1] - out)
                    self._add(("out", k + 1), out)
                    done = self.loss_done if k + 1 == c.length else k + 1 in self.backward_done
                    if done:
                        self._drop_x(k + 1)
                else:
                    self._add(("x", k + 1), c.x_sizes[k + 1])
                    if kind == "Fn":
                        self._drop(("x", k))
                if kind != "Fn" and self.persistent and ("x", k) in self.alive:
                    self.checkpoints.add(k)
        self.peak = max(self.peak, peak)
        self._index += 1
        return peak


def simulate(chain: Chain, ops: Iterable[Op]) -> Simulation:
    """Replay ``ops`` on ``chain``: exact time and peak memory of a complete schedule.

    Raises:
        InvalidArgumentError: an op reads a value that is not alive, computes one twice, or the
            schedule ends before the gradient w.r.t. the chain input is computed.
        ArgumentTypeError: ``chain`` is not a ``Chain`` or ``ops`` is not an iterable.

    Example:
        >>> chain = Chain([1, 1], [1, 1], [4, 4, 4], [0, 8, 8], [0, 0], [0, 0])
        >>> sim = simulate(chain, [("Fck", 0), ("Fe", 1), ("Loss",), ("B", 1), ("Fe", 0), ("B", 0)])
        >>> (sim.time, sim.peak)
        (5.0, 24)
    """
    if not isinstance(chain, Chain):
        raise ArgumentTypeError(
            f"tensorscope.checkpoint: simulate() takes a Chain; got {type(chain).__name__}."
        )
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Iterable):
        raise ArgumentTypeError(
            "tensorscope.checkpoint: simulate() takes the schedule's ops as an iterable of "
            f"tuples such as ('Fe', 0); got {type(ops).__name__}."
        )
    sim = Simulator(chain)
    peaks = [sim.step(op) for op in ops]
    if not sim.complete:
        raise InvalidArgumentError(
            "tensorscope.checkpoint: invalid schedule: it ends before B(0) computes the "
            "gradient w.r.t. the chain input"
        )
    return Simulation(sim.time, sim.peak, tuple(peaks))
