"""Optimal checkpointing of a chain under a memory limit: rotor's persistent dynamic program.

Pure Python, no torch import (a test checks it): plain numbers in, a :class:`Schedule` out.
"""

from __future__ import annotations

import math
from operator import add

from tensorscope._units import format_bytes, parse_bytes
from tensorscope.checkpoint.chain import Chain, Op, Schedule
from tensorscope.checkpoint.simulate import simulate
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError, ScheduleError

__all__ = ["MAX_TABLE_WORK", "min_memory", "solve", "store_all_memory", "store_all_ops"]

INF = math.inf
INF_SIZE = 1 << 62  # a need no memory meets (integer: the table indexes by it)

#: Refuse an exact solve whose table work (cells x options) exceeds this; pass ``slots=``.
MAX_TABLE_WORK = 150_000_000

# NOTE [the dynamic program]
# Sub-problem (i, l), 0 <= i <= l <= L: back-propagate through layers i..l given x_i alive
# (plain, or as the output inside xbar[i]) and, when l < L, the gradient d[l+1] alive; when
# l == L the sub-problem ends with the loss and there is no incoming gradient. It ends with
# B(i) (or the loss alone, for (L, L)), which leaves d[i]. opt(m, i, l) is its least time when
# everything it holds -- x_i, d[l+1], and all it creates -- never exceeds m; whatever outer
# levels keep alive is taken out of m by the caller. Two choices:
#   Fe(i), (i+1, l), B(i): the child counts x_{i+1} itself, so it gets
#       m - (x_i + xbar_{i+1} - x_{i+1}); Fe(i) and B(i) must fit m on their own (B(i) without
#       x_{i+1} if layer i does not keep its output: the child's B(i+1) freed it).
#   Fck(i) Fn(i+1) .. Fn(j-1), then (j, l) with x_i held outside it (m - x_i), then (i, j-1),
#       which starts from x_i and d[j]: the checkpoint x_j was freed by (j, l)'s B(j).
# The output gradient d[L], created by the loss, stays alive to the end (autograd holds it).
# Sub-problems with l < L - 1 run after the loss and leave it outside their m; those with
# l >= L - 1 hold it once B(L-1) (or the loss) ran: their B(i), i < L - 1, counts it, and their
# left child (i, j-1) gets m - x_L unless d[L] is that child's own incoming gradient (j = L).
# A layer with Fs (NOTE [selective recomputation], simulate.py) has a second first choice,
#   Fs(i), (i+1, l), B(i): the same with xsel for xbar, its output freed as by a layer that
#       keeps none, sel_bw_tmp for bw_tmp and sel_bw more time; at (i, i) it is Fs(i) B(i).
# Every term is the simulator's (simulate.py), not a re-derivation: each schedule the table
# describes simulates to the same time and to a peak <= m (rotor's own Fe(i) test is known to
# use the wrong gradient size and can exceed its budget). Tests brute-force all valid
# schedules of tiny chains against it.
#
# NOTE [fast table]
# opt(., i, l) is non-increasing in m, infinite below lo(i, l) (the least memory of any
# schedule, an O(L^3) recurrence without the m dimension) and equal to the store-all time at
# and above hi(i, l) (the store-all peak: every layer's forward and backward run exactly once,
# nothing can be faster). Only the band [lo, hi) is tabulated, one list per (i, l), and each
# choice is evaluated for the whole band at once with map() over lists, which runs at C
# speed. The choice is not stored: the schedule is rebuilt by re-evaluating the few choices
# on its path, which costs O(L) per visited sub-problem.


class _Terms:
    """Integer sizes, times and the per-(i, l) constants of the recurrence."""

    def __init__(self, chain: Chain) -> None:
        c = chain
        n = self.n = c.length
        self.x = c.x_sizes
        self.xb = c.xbar_sizes
        self.fwd = [0.0] * (n + 1)
        for k in range(n):
            self.fwd[k + 1] = self.fwd[k] + c.fw[k]
        self.fwbw = [c.fw[k] + c.bw[k] for k in range(n)]
        self.store_all_time = [[0.0] * (n + 1) for _ in range(n + 1)]
        for i in range(n - 1, -1, -1):
            for l_ in range(i, n + 1):
                rest = self.store_all_time[i + 1][l_] if i + 1 <= l_ else 0.0
                self.store_all_time[i][l_] = self.fwbw[i] + rest
        x, xb = self.x, self.xb
        # Option Fe(i): shift of the child's budget, needs of Fe(i) (without d[l+1]) and B(i).
        self.shift = [x[i] + xb[i + 1] - x[i + 1] for i in range(n)]
        self.fe_need = [x[i] + xb[i + 1] + c.fw_tmp[i] for i in range(n)]
        # B(i) reads xbar[i+1] (less its output if layer i does not keep it: B(i+1) freed it).
        self.b_need = [
            2 * x[i] + xb[i + 1] + (x[i + 1] if c.keeps_output[i] else 0) + c.bw_tmp[i]
            for i in range(n)
        ]
        # The same for Fs(i), where layer i has it (None where not).
        xs = c.xsel_sizes
        self.sel = [c.selective(i) for i in range(n)]
        self.shift_s = [x[i] + xs[i + 1] - x[i + 1] for i in range(n)]
        self.fe_need_s = [x[i] + xs[i + 1] + c.fw_tmp[i] for i in range(n)]
        self.b_need_s = [2 * x[i] + xs[i + 1] + c.sel_bw_tmp[i] for i in range(n)]
        self.fwbw_s = [c.fw[k] + c.bw[k] + c.sel_bw[k] for k in range(n)]
        self.loss_need = 2 * x[n] + c.loss_tmp
        # The output gradient d[L] stays alive from the loss to the end (simulate.py).
        self.kept = x[n]
        # sweep[i][j]: peak above x_i and d[l+1] of Fck(i) Fn(i+1) .. Fn(j-1), for j > i.
        self.sweep = [[0] * (n + 1) for _ in range(n + 1)]
        for i in range(n):
            need = x[i + 1] + c.fw_tmp[i]
            self.sweep[i][i + 1] = need
            for j in range(i + 2, n + 1):
                need = max(need, x[j - 1] + x[j] + c.fw_tmp[j - 1])
                self.sweep[i][j] = need

    def grad_in(self, l_: int) -> int:
        return self.x[l_ + 1] if l_ < self.n else 0

    def own_need(self, i: int, l_: int) -> int:
        """Peak of Fe(i) and of B(i) within sub-problem (i, l) (d[L] counted where held)."""
        late = l_ >= self.n - 1 and i < self.n - 1  # B(i) runs after B(L-1), d[L] still held
        return max(self.fe_need[i] + self.grad_in(l_), self.b_need[i] + late * self.kept)

    def own_need_s(self, i: int, l_: int) -> int:
        """``own_need`` with Fs(i) for Fe(i) (infinite where layer i has no Fs)."""
        if not self.sel[i]:
            return INF_SIZE
        late = l_ >= self.n - 1 and i < self.n - 1
        return max(self.fe_need_s[i] + self.grad_in(l_), self.b_need_s[i] + late * self.kept)

    def left_shift(self, l_: int, j: int) -> int:
        """What the left child (i, j-1) of (i, l) must leave to d[L]: all of it if d[L] is
        alive when it starts (l >= L-1) but not its own incoming gradient (j-1 < L-1)."""
        return self.kept if l_ >= self.n - 1 and j - 1 < self.n - 1 else 0

    def bounds(self) -> tuple[list[list[int]], list[list[int]]]:
        """lo[i][l] (least memory of any schedule) and hi[i][l] (store-all peak)."""
        n, x = self.n, self.x
        lo = [[0] * (n + 1) for _ in range(n + 1)]
        hi = [[0] * (n + 1) for _ in range(n + 1)]
        lo[n][n] = hi[n][n] = self.loss_need
        for i in range(n - 1, -1, -1):
            for l_ in range(i, n + 1):
                own, own_s = self.own_need(i, l_), self.own_need_s(i, l_)
                if l_ == i:
                    hi[i][l_] = own
                    lo[i][l_] = min(own, own_s)
                    continue
                hi[i][l_] = max(own, hi[i + 1][l_] + self.shift[i])
                best = max(own, lo[i + 1][l_] + self.shift[i])
                if self.sel[i]:
                    best = min(best, max(own_s, lo[i + 1][l_] + self.shift_s[i]))
                g = self.grad_in(l_)
                for j in range(i + 1, l_ + 1):
                    left = lo[i][j - 1] + self.left_shift(l_, j)
                    need = max(x[i] + g + self.sweep[i][j], lo[j][l_] + x[i], left)
                    best = min(best, need)
                lo[i][l_] = best
        return lo, hi


class _Table:
    """opt(m, i, l) for m in 0..limit, stored as bands (see NOTE [fast table])."""

    def __init__(self, t: _Terms, limit: int) -> None:
        self.t = t
        self.limit = limit
        self.lo, self.hi = t.bounds()
        n = t.n
        self.band: list[list[list[float]]] = [[[] for _ in range(n + 1)] for _ in range(n + 1)]

    def work(self) -> int:
        """Cells times choices the fill will evaluate."""
        n, total = self.t.n, 0
        for i in range(n + 1):
            for l_ in range(i, n + 1):
                width = min(self.hi[i][l_], self.limit + 1) - self.lo[i][l_]
                total += max(0, width) * (l_ - i + 1)
        return total

    def window(self, i: int, l_: int, start: int, stop: int) -> list[float]:
        """opt(m, i, l) for m in [start, stop) (stop <= limit + 1)."""
        lo, hi = self.lo[i][l_], self.hi[i][l_]
        size = stop - start
        n_inf = min(max(lo - start, 0), size)
        n_top = min(max(stop - hi, 0), size)
        mid = self.band[i][l_][max(start, lo) - lo : max(min(stop, hi) - lo, 0)]
        return [INF] * n_inf + mid + [self.t.store_all_time[i][l_]] * n_top

    def value(self, i: int, l_: int, m: int) -> float:
        if m < self.lo[i][l_]:
            return INF
        if m >= self.hi[i][l_]:
            return self.t.store_all_time[i][l_]
        return self.band[i][l_][m - self.lo[i][l_]]

    def fill(self) -> None:
        t, n = self.t, self.t.n
        for i in range(n):  # (i, i) below Fe(i)'s need: Fs(i) B(i) where layer i has it
            a, b = self.lo[i][i], min(self.hi[i][i], self.limit + 1)
            if b > a:
                self.band[i][i] = [t.fwbw_s[i]] * (b - a)
        for span in range(1, n + 1):
            for i in range(0, n + 1 - span):
                l_ = i + span
                a, b = self.lo[i][l_], min(self.hi[i][l_], self.limit + 1)
                if b <= a:
                    continue
                cands: list[list[float]] = []
                firsts = [(t.own_need(i, l_), t.shift[i], t.fwbw[i])]
                if t.sel[i]:
                    firsts.append((t.own_need_s(i, l_), t.shift_s[i], t.fwbw_s[i]))
                for own, s, cost in firsts:
                    start = max(a, own)
                    if start < b:
                        child = self.window(i + 1, l_, start - s, b - s)
                        cands.append([INF] * (start - a) + list(map(cost.__add__, child)))
                base = t.x[i] + t.grad_in(l_)
                for j in range(i + 1, l_ + 1):
                    ls = t.left_shift(l_, j)
                    start = max(a, base + t.sweep[i][j])
                    if start >= b:
                        break  # the sweep only gets more expensive with j
                    right = self.window(j, l_, start - t.x[i], b - t.x[i])
                    left = self.window(i, j - 1, start - ls, b - ls)
                    cost = t.fwd[j] - t.fwd[i]
                    both = map(cost.__add__, map(add, right, left))
                    cands.append([INF] * (start - a) + list(both))
                if len(cands) == 1:
                    self.band[i][l_] = cands[0]
                elif cands:
                    self.band[i][l_] = list(map(min, *cands))

    def choices(self, i: int, l_: int, m: int) -> list[tuple[float, int]]:
        """(time, j) for each feasible choice at (m, i, l); j == i means Fe(i), j == -1 Fs(i)
        (listed after Fe(i): a tie keeps the plain forward)."""
        t = self.t
        out: list[tuple[float, int]] = []
        if m >= t.own_need(i, l_):
            out.append((t.fwbw[i] + self.value(i + 1, l_, m - t.shift[i]), i))
        if m >= t.own_need_s(i, l_):
            out.append((t.fwbw_s[i] + self.value(i + 1, l_, m - t.shift_s[i]), -1))
        base = t.x[i] + t.grad_in(l_)
        for j in range(i + 1, l_ + 1):
            if m < base + t.sweep[i][j]:
                break
            right = self.value(j, l_, m - t.x[i])
            left = self.value(i, j - 1, m - t.left_shift(l_, j))
            out.append(((t.fwd[j] - t.fwd[i]) + (right + left), j))
        return out

    def ops(self, m: int) -> list[Op]:
        """Rebuild the schedule of opt(m, 0, L), iteratively (deep chains overflow recursion)."""
        t, n = self.t, self.t.n
        out: list[Op] = []
        stack: list[tuple[int, int, int] | Op] = [(0, n, m)]
        while stack:
            task = stack.pop()
            if len(task) != 3:
                out.append(task)
                continue
            i, l_, mem = task
            if i == n:
                out.append(("Loss",))
            elif mem >= self.hi[i][l_]:
                out.extend(store_all_ops(i, l_, n))
            elif i == l_:
                out += [("Fs", i), ("B", i)]
            else:
                _, j = min(self.choices(i, l_, mem), key=lambda c: c[0])
                if j == i:
                    stack += [("B", i), (i + 1, l_, mem - t.shift[i])]
                    out.append(("Fe", i))
                elif j == -1:
                    stack += [("B", i), (i + 1, l_, mem - t.shift_s[i])]
                    out.append(("Fs", i))
                else:
                    stack += [(i, j - 1, mem - t.left_shift(l_, j)), (j, l_, mem - t.x[i])]
                    out.append(("Fck", i))
                    out.extend(("Fn", k) for k in range(i + 1, j))
        return out


def store_all_ops(i: int, l_: int, n: int) -> list[Op]:
    """Ops of the store-all schedule of sub-chain (i, l) of a chain of ``n`` layers.

    Example:
        >>> store_all_ops(0, 2, 2)
        [('Fe', 0), ('Fe', 1), ('Loss',), ('B', 1), ('B', 0)]
    """
    last = min(l_, n - 1)
    ops: list[Op] = [("Fe", k) for k in range(i, last + 1)]
    if l_ == n:
        ops.append(("Loss",))
    ops.extend(("B", k) for k in range(last, i - 1, -1))
    return ops


def min_memory(chain: Chain) -> int:
    """The smallest memory limit any schedule of ``chain`` fits in (exact).

    Example:
        >>> min_memory(Chain([1, 1], [1, 1], [4, 4, 4], [0, 8, 8], [0, 0], [0, 0]))
        24
    """
    lo, _ = _Terms(chain).bounds()
    return lo[0][chain.length]


def store_all_memory(chain: Chain) -> int:
    """Peak memory of the store-all schedule (no recomputation); larger limits change nothing.

    Example:
        >>> store_all_memory(Chain([1, 1], [1, 1], [4, 4, 4], [0, 8, 8], [0, 0], [0, 0]))
        28
    """
    _, hi = _Terms(chain).bounds()
    return hi[0][chain.length]


def _min_memory_ops(chain: Chain) -> list[Op]:
    """A schedule reaching :func:`min_memory` (fallback when rounding to slots is too coarse)."""
    t = _Terms(chain)
    lo, _ = t.bounds()
    n, x = t.n, t.x
    out: list[Op] = []
    stack: list[tuple[int, int] | Op] = [(0, n)]
    while stack:
        task = stack.pop()
        if isinstance(task[0], str):
            out.append(task)
            continue
        i, l_ = task
        if i == n:
            out.append(("Loss",))
            continue
        if i == l_:
            fits = t.own_need(i, l_) <= t.own_need_s(i, l_)
            out.extend(store_all_ops(i, l_, n) if fits else [("Fs", i), ("B", i)])
            continue
        g = t.grad_in(l_)
        best, best_j = max(t.own_need(i, l_), lo[i + 1][l_] + t.shift[i]), i
        if t.sel[i]:
            need = max(t.own_need_s(i, l_), lo[i + 1][l_] + t.shift_s[i])
            if need < best:
                best, best_j = need, -1
        for j in range(i + 1, l_ + 1):
            left = lo[i][j - 1] + t.left_shift(l_, j)
            need = max(x[i] + g + t.sweep[i][j], lo[j][l_] + x[i], left)
            if need < best:
                best, best_j = need, j
        if best_j in (i, -1):
            stack += [("B", i), (i + 1, l_)]
            out.append(("Fe", i) if best_j == i else ("Fs", i))
        else:
            stack += [(i, best_j - 1), (best_j, l_)]
            out.append(("Fck", i))
            out.extend(("Fn", k) for k in range(i + 1, best_j))
    return out


def _nearest_slots(chain: Chain, limit: int, slots: int) -> tuple[list[Op], float] | None:
    """NOTE [rounding to slots]: rounding every size up wastes half a slot per live value on
    average. Solve on sizes rounded to nearest instead, then walk the table down from `slots`
    units (every smaller budget is already tabulated) until a schedule fits the real limit when
    simulated on the real sizes; the first that fits is the fastest of those. None if none is
    found within a few steps: the caller then rounds up, which always fits."""
    table = _Table(_Terms(chain.scaled(slots, limit, up=False)), slots)
    n = chain.length
    if table.lo[0][n] > slots:
        return None
    table.fill()
    for m in range(slots, max(table.lo[0][n], slots - 64) - 1, -1):
        ops = table.ops(m)
        if simulate(chain, ops).peak <= limit:
            return ops, table.value(0, n, m)
    return None


def _too_small(chain: Chain, limit: int, least: int, top: int, unit: str) -> ScheduleError:
    return ScheduleError(
        f"tensorscope.checkpoint: no schedule fits mem_limit={limit} ({format_bytes(limit)}"
        f"{unit}); the smallest limit that fits this {chain.length}-layer chain is {least} "
        f"({format_bytes(least)}), and storing every activation needs {top} "
        f"({format_bytes(top)}). Raise mem_limit to at least {format_bytes(least)}, or shrink "
        f"the activations (smaller batch, split the largest layers into several)."
    )


def solve(chain: Chain, mem_limit: int | str, *, slots: int | None = None) -> Schedule:
    """The fastest schedule of ``chain`` whose peak memory stays within ``mem_limit``.

    Exact (``slots=None``): the dynamic program runs on the integer sizes as given, over every
    memory value up to the limit, so its cost grows with ``mem_limit`` -- use a coarse unit, or
    ``slots``. With ``slots=n`` the sizes are measured in units of ``mem_limit / n`` and the
    limit is ``n`` units (NOTE [rounding to slots]): the schedule may be slightly slower than
    the exact optimum but always fits the real limit (its ``peak`` is simulated on the real
    sizes). If rounding leaves no schedule although one fits, the least-memory schedule is
    returned.

    Args:
        chain: per-layer times and sizes.
        mem_limit: bytes (``int``, in the chain's unit) or a string such as ``"2GiB"``; covers
            everything the chain allocates, its input included.
        slots: discretise the memory into this many units (``Checkpointable`` uses 500).

    Raises:
        ScheduleError: no schedule fits; the message gives the smallest limit that would.
        InvalidArgumentError: an exact table would be too large (pass ``slots``), or ``slots``
            is not a positive int.
        ArgumentTypeError: ``chain`` is not a ``Chain``.

    Example:
        >>> chain = Chain([1, 1], [1, 1], [4, 4, 4], [0, 8, 8], [0, 0], [0, 0])
        >>> solve(chain, 100).time, solve(chain, 24).time
        (4.0, 5.0)
        >>> solve(chain, 24).ops
        (('Fck', 0), ('Fe', 1), ('Loss',), ('B', 1), ('Fe', 0), ('B', 0))
    """
    if not isinstance(chain, Chain):
        raise ArgumentTypeError(
            f"tensorscope.checkpoint: solve() takes a Chain; got {type(chain).__name__}."
        )
    limit = parse_bytes(mem_limit, what="mem_limit", subsystem="tensorscope.checkpoint")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise InvalidArgumentError(
            f"tensorscope.checkpoint: slots must be a positive int (rotor uses 500); got {slots!r}"
        )
    t = _Terms(chain)
    lo, hi = t.bounds()
    n = chain.length
    least, top = lo[0][n], hi[0][n]
    if limit < least:
        raise _too_small(chain, limit, least, top, "")
    found = None if slots is None or limit >= top else _nearest_slots(chain, limit, slots)
    if limit >= top:
        ops, time = store_all_ops(0, n, n), t.store_all_time[0][n]
    elif found is not None:
        ops, time = found
    else:
        scaled = chain if slots is None else chain.scaled(slots, limit)
        table = _Table(_Terms(scaled), limit if slots is None else slots)
        if slots is None and table.work() > MAX_TABLE_WORK:
            raise InvalidArgumentError(
                f"tensorscope.checkpoint: an exact solve at mem_limit={limit} would evaluate "
                f"{table.work():,} table cells; express sizes in a coarser unit or pass "
                f"slots=500 (rounded sizes; the schedule is checked on the real ones)"
            )
        if table.lo[0][n] > table.limit:
            ops = _min_memory_ops(chain)
            time = simulate(chain, ops).time
        else:
            table.fill()
            ops, time = table.ops(table.limit), table.value(0, n, table.limit)
            if slots is not None:
                fallback = _min_memory_ops(chain)
                fb_time = simulate(chain, fallback).time
                if fb_time < time:
                    ops, time = fallback, fb_time
    peak = simulate(chain, ops).peak
    if peak > limit:  # pragma: no cover - the tests show this cannot happen
        raise AssertionError(f"tensorscope.checkpoint: solver bug: peak {peak} > limit {limit}")
    return Schedule(time=time, peak=peak, ops=tuple(ops), mem_limit=limit)
