"""The data the checkpoint solver works on: a :class:`Chain` in, a :class:`Schedule` out.

Pure Python, no torch: the solver and the simulator are tested on plain numbers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from tensorscope.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["Chain", "Op", "Schedule", "format_ops", "forward_runs"]

#: One step of a schedule: ``("Fn", k)``, ``("Fck", k)``, ``("Fe", k)``, ``("Fs", k)``,
#: ``("B", k)`` or ``("Loss",)``. See docs/api.md §5 and ``docs/checkpoint.md`` for what each one
#: does to memory; ``Fs`` is NOTE [selective recomputation] (simulate.py).
Op: TypeAlias = tuple[str, int] | tuple[str]

FORWARD_KINDS = ("Fn", "Fck", "Fe", "Fs")

_PREFIX = "tensorscope.checkpoint:"


def forward_runs(ops: Iterable[Op]) -> Counter[int]:
    """How many times a schedule runs each layer's forward (more than once: recomputed).

    Example:
        >>> forward_runs([("Fck", 0), ("Fe", 1), ("Loss",), ("B", 1), ("Fe", 0), ("B", 0)])
        Counter({0: 2, 1: 1})
    """
    return Counter(op[1] for op in ops if op[0] in FORWARD_KINDS)  # type: ignore[misc]


def _times(name: str, values: Sequence[float], length: int) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ArgumentTypeError(f"{_PREFIX} Chain.{name} must be a sequence of numbers")
    if len(values) != length:
        raise InvalidArgumentError(
            f"{_PREFIX} Chain.{name} has {len(values)} entries, expected {length} (one per layer)"
        )
    out: list[float] = []
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ArgumentTypeError(f"{_PREFIX} Chain.{name}[{k}] must be a number; got {v!r}")
        if not math.isfinite(v) or v < 0:
            raise InvalidArgumentError(
                f"{_PREFIX} Chain.{name}[{k}] must be a finite time >= 0 seconds; got {v!r}"
            )
        out.append(float(v))
    return tuple(out)


def _sizes(name: str, values: Sequence[int], length: int, what: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ArgumentTypeError(f"{_PREFIX} Chain.{name} must be a sequence of ints")
    if len(values) != length:
        raise InvalidArgumentError(
            f"{_PREFIX} Chain.{name} has {len(values)} entries, expected {length} ({what})"
        )
    out: list[int] = []
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ArgumentTypeError(
                f"{_PREFIX} Chain.{name}[{k}] must be an int (bytes, or any integer unit); "
                f"got {v!r}. Round sizes up to whole units."
            )
        if v < 0:
            raise InvalidArgumentError(f"{_PREFIX} Chain.{name}[{k}] must be >= 0; got {v}")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True, init=False)
class Chain:
    """A sequential model, as the solver sees it: per-layer times and sizes.

    ``L`` layers, indexed ``k = 0 .. L-1``; sizes are integers (bytes, or any unit as long as the
    memory limit uses the same one), times are seconds.

    Attributes:
        fw: ``fw[k]`` forward time of layer ``k``.
        bw: ``bw[k]`` backward time of layer ``k``.
        x_sizes: ``L + 1`` entries: ``x_sizes[0]`` the chain input, ``x_sizes[k + 1]`` layer
            ``k``'s output computed without autograd; also the size of the gradient w.r.t. it.
        xbar_sizes: ``L + 1`` entries: ``xbar_sizes[k + 1]`` what stays allocated after running
            layer ``k`` with autograd: its output plus the tensors it saved for backward that did
            not exist before (``xbar_sizes[0]`` is unused). Must be ``>= x_sizes[k + 1]``.
        fw_tmp: ``fw_tmp[k]`` transient peak of layer ``k``'s forward on top of its input and
            its result (``x`` without autograd, ``xbar`` with).
        bw_tmp: ``bw_tmp[k]`` transient peak of layer ``k``'s backward on top of everything it
            reads and the input gradient it produces.
        loss_tmp: transient peak of the loss (forward and backward) on top of the chain output
            and its gradient.
        keeps_output: keyword-only, ``L`` flags: whether layer ``k``'s autograd state holds its
            own output (``ReLU``, ``Tanh`` save their result; ``Linear``, ``GELU`` do not). When
            it does not, the output part of ``xbar[k + 1]`` is freed once the next layer's
            backward (or the loss) no longer needs it, not at ``B(k)``. Default: all ``True``,
            rotor's (conservative) model.
        xsel_sizes: keyword-only, ``L + 1`` entries like ``xbar_sizes``: what stays allocated
            after ``Fs(k)`` (NOTE [selective recomputation], simulate.py): the output plus the
            results of the expensive ops kept for the replay. Where it is not below
            ``xbar_sizes[k + 1]`` layer ``k`` has no ``Fs``. Default: ``xbar_sizes`` (none).
        sel_bw: keyword-only, ``L`` times: what ``B(k)`` after ``Fs(k)`` adds to ``bw[k]`` (the
            replay of the cheap ops). Default: zeros.
        sel_bw_tmp: keyword-only, ``L`` sizes: ``B(k)``'s transient after ``Fs(k)`` (its replay's
            saved tensors and output, and ``bw_tmp[k]``). Default: ``bw_tmp``.

    Example:
        >>> chain = Chain([1, 1], [2, 2], [4, 4, 4], [0, 8, 8], [0, 0], [0, 0])
        >>> chain.length
        2
    """

    fw: tuple[float, ...]
    bw: tuple[float, ...]
    x_sizes: tuple[int, ...]
    xbar_sizes: tuple[int, ...]
    fw_tmp: tuple[int, ...]
    bw_tmp: tuple[int, ...]
    loss_tmp: int
    keeps_output: tuple[bool, ...]
    xsel_sizes: tuple[int, ...]
    sel_bw: tuple[float, ...]
    sel_bw_tmp: tuple[int, ...]

    def __init__(
        self,
        fw: Sequence[float],
        bw: Sequence[float],
        x_sizes: Sequence[int],
        xbar_sizes: Sequence[int],
        fw_tmp: Sequence[int],
        bw_tmp: Sequence[int],
        loss_tmp: int = 0,
        *,
        keeps_output: Sequence[bool] | None = None,
        xsel_sizes: Sequence[int] | None = None,
        sel_bw: Sequence[float] | None = None,
        sel_bw_tmp: Sequence[int] | None = None,
    ) -> None:
        if isinstance(fw, (str, bytes)) or not isinstance(fw, Sequence):
            raise ArgumentTypeError(f"{_PREFIX} Chain.fw must be a sequence of numbers")
        n = len(fw)
        if n < 1:
            raise InvalidArgumentError(f"{_PREFIX} a Chain needs at least one layer")
        set_ = object.__setattr__
        set_(self, "fw", _times("fw", fw, n))
        set_(self, "bw", _times("bw", bw, n))
        set_(self, "x_sizes", _sizes("x_sizes", x_sizes, n + 1, "input, then one per layer"))
        xbar = _sizes("xbar_sizes", xbar_sizes, n + 1, "unused slot 0, then one per layer")
        set_(self, "xbar_sizes", xbar)
        set_(self, "fw_tmp", _sizes("fw_tmp", fw_tmp, n, "one per layer"))
        set_(self, "bw_tmp", _sizes("bw_tmp", bw_tmp, n, "one per layer"))
        set_(self, "loss_tmp", _sizes("loss_tmp", [loss_tmp], 1, "a single int")[0])
        keeps = [True] * n if keeps_output is None else list(keeps_output)
        if len(keeps) != n or not all(isinstance(v, bool) for v in keeps):
            raise InvalidArgumentError(
                f"{_PREFIX} Chain.keeps_output must be {n} bools (one per layer); "
                f"got {keeps_output!r}"
            )
        set_(self, "keeps_output", tuple(keeps))
        for k in range(1, n + 1):
            if xbar[k] < self.x_sizes[k]:
                raise InvalidArgumentError(
                    f"{_PREFIX} Chain.xbar_sizes[{k}] = {xbar[k]} is smaller than "
                    f"x_sizes[{k}] = {self.x_sizes[k]}; xbar counts the output plus what layer "
                    f"{k - 1} saves for backward, so it is at least the output size"
                )
        xsel = xbar if xsel_sizes is None else xsel_sizes
        xsel = _sizes("xsel_sizes", xsel, n + 1, "unused slot 0, then one per layer")
        for k in range(1, n + 1):
            if xsel[k] < self.x_sizes[k]:
                raise InvalidArgumentError(
                    f"{_PREFIX} Chain.xsel_sizes[{k}] = {xsel[k]} is smaller than "
                    f"x_sizes[{k}] = {self.x_sizes[k]}; it counts the output too"
                )
        set_(self, "xsel_sizes", tuple(min(a, b) for a, b in zip(xsel, xbar, strict=True)))
        set_(self, "sel_bw", _times("sel_bw", [0.0] * n if sel_bw is None else sel_bw, n))
        tmp = self.bw_tmp if sel_bw_tmp is None else sel_bw_tmp
        set_(self, "sel_bw_tmp", _sizes("sel_bw_tmp", tmp, n, "one per layer"))

    @property
    def length(self) -> int:
        """Number of layers ``L``."""
        return len(self.fw)

    def selective(self, k: int) -> bool:
        """Whether layer ``k`` has ``Fs``: it keeps less than ``Fe`` does.

        Example:
            >>> c = Chain([1], [1], [2, 2], [0, 9], [0], [0], xsel_sizes=[0, 5])
            >>> c.selective(0), Chain([1], [1], [2, 2], [0, 9], [0], [0]).selective(0)
            (True, False)
        """
        return self.xsel_sizes[k + 1] < self.xbar_sizes[k + 1]

    def scaled(self, slots: int, mem_limit: int, *, up: bool = True) -> Chain:
        """Sizes in units of ``mem_limit / slots``, rounded up (or to nearest); same times.

        Rounded up, a schedule that fits ``slots`` units fits ``mem_limit`` with the real
        sizes: every peak is a sum of sizes, and each size only grew.

        Example:
            >>> Chain([1], [1], [10, 25], [0, 30], [0], [5]).scaled(10, 100).x_sizes
            (1, 3)
            >>> Chain([1], [1], [10, 25], [0, 30], [0], [5]).scaled(10, 100, up=False).x_sizes
            (1, 3)
        """

        def unit(values: tuple[int, ...]) -> list[int]:
            if up:
                return [-(-v * slots // mem_limit) for v in values]
            return [(2 * v * slots + mem_limit) // (2 * mem_limit) for v in values]

        return Chain(
            self.fw,
            self.bw,
            unit(self.x_sizes),
            unit(self.xbar_sizes),
            unit(self.fw_tmp),
            unit(self.bw_tmp),
            unit((self.loss_tmp,))[0],
            keeps_output=self.keeps_output,
            xsel_sizes=unit(self.xsel_sizes),
            sel_bw=self.sel_bw,
            sel_bw_tmp=unit(self.sel_bw_tmp),
        )


@dataclass(frozen=True)
class Schedule:
    """A checkpointing schedule for a :class:`Chain` and its predicted cost.

    Attributes:
        time: predicted time in seconds (the sum of the forward and backward times it runs).
        peak: exact peak memory of the schedule on the chain's real sizes (same unit as the
            chain's sizes; bytes for measured models).
        ops: the operations, in order, in the API vocabulary: ``("Fn", k)``, ``("Fck", k)``,
            ``("Fe", k)``, ``("Fs", k)``, ``("Loss",)``, ``("B", k)``.
        mem_limit: the limit the schedule was solved for.

    Example:
        >>> from tensorscope.checkpoint import Chain, solve
        >>> s = solve(Chain([1], [2], [4, 4], [0, 8], [0], [0]), 100)
        >>> s.ops
        (('Fe', 0), ('Loss',), ('B', 0))
        >>> (s.time, s.peak)
        (3.0, 20)
    """

    time: float
    peak: int
    ops: tuple[Op, ...]
    mem_limit: int

    def __str__(self) -> str:
        return f"Schedule(time={self.time:.6g}, peak={self.peak}, ops={format_ops(self.ops)})"


def format_ops(ops: Sequence[Op]) -> str:
    """Compact text for a list of ops: ``"Fck0 Fn1 Fe2 Loss B2 ..."``.

    Example:
        >>> format_ops([("Fe", 0), ("Loss",), ("B", 0)])
        'Fe0 Loss B0'
    """
    return " ".join(op[0] if len(op) == 1 else f"{op[0]}{op[1]}" for op in ops)
