"""Test helpers: chain strategies, and brute force over every valid schedule of a tiny chain.

Brute force is Dijkstra on the simulator's states.
The simulator's state (the set of alive values) determines everything that matters for the
rest of a schedule, and every op's peak depends only on it, so a shortest path over states is
an exhaustive search over schedules: no structure of the dynamic program is assumed.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
from collections.abc import Callable

from hypothesis import strategies as st

from tensorscope.checkpoint.chain import Chain, Op
from tensorscope.checkpoint.simulate import Simulator
from tensorscope.errors import InvalidArgumentError


def all_ops(n: int) -> list[Op]:
    ops: list[Op] = [("Loss",)]
    for k in range(n):
        ops += [("Fn", k), ("Fck", k), ("Fe", k), ("Fs", k), ("B", k)]
    return ops


def _search(
    chain: Chain, initial: float, cost: Callable[[float, int, float], float], persistent: bool
) -> float:
    """Least accumulated cost of a complete schedule; ``cost(acc, op_peak, op_seconds)``."""
    ops = all_ops(chain.length)
    tie = itertools.count()
    heap: list[tuple[float, int, Simulator]] = [
        (initial, 0, Simulator(chain, persistent=persistent))
    ]
    done: set[frozenset[tuple[str, int]]] = set()
    while heap:
        acc, _, sim = heapq.heappop(heap)
        state = sim.state()
        if state in done:
            continue
        done.add(state)
        if sim.complete:
            return acc
        for op in ops:
            try:
                peak = sim.check(op)
            except InvalidArgumentError:
                continue
            nxt = copy.copy(sim)
            nxt.alive = dict(sim.alive)
            nxt.backward_done = set(sim.backward_done)
            nxt.checkpoints = set(sim.checkpoints)
            nxt.step(op)
            new = cost(acc, peak, nxt.time - sim.time)
            if math.isinf(new):
                continue
            if nxt.state() not in done:
                heapq.heappush(heap, (new, next(tie), nxt))
    return math.inf


def best_time(chain: Chain, limit: int, *, persistent: bool = True) -> float:
    """Least time of any valid schedule whose every op fits ``limit`` (inf if none)."""

    def cost(acc: float, peak: int, seconds: float) -> float:
        return math.inf if peak > limit else acc + seconds

    if chain.x_sizes[0] > limit:
        return math.inf
    return _search(chain, 0.0, cost, persistent)


def least_memory(chain: Chain, *, persistent: bool = True) -> float:
    """Least peak of any valid schedule."""
    return _search(
        chain, float(chain.x_sizes[0]), lambda acc, peak, op: max(acc, float(peak)), persistent
    )


@st.composite
def chains(draw: st.DrawFn, max_layers: int = 4, max_size: int = 6) -> Chain:
    """Small chains with integer times (so sums are exact) and integer sizes."""
    n = draw(st.integers(1, max_layers))
    size = st.integers(0, max_size)
    small = st.integers(0, 3)
    x = draw(st.lists(size, min_size=n + 1, max_size=n + 1))
    extra = draw(st.lists(size, min_size=n, max_size=n))
    sel = draw(st.lists(size, min_size=n, max_size=n))  # of extra: what Fs keeps
    more = draw(st.lists(small, min_size=n, max_size=n))
    bw_tmp = draw(st.lists(small, min_size=n, max_size=n))
    return Chain(
        draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)),
        draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)),
        x,
        [0] + [x[k + 1] + extra[k] for k in range(n)],
        draw(st.lists(small, min_size=n, max_size=n)),
        bw_tmp,
        draw(small),
        keeps_output=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        xsel_sizes=[0] + [x[k + 1] + min(sel[k], extra[k]) for k in range(n)],
        sel_bw=draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),
        # the replay saves what Fs did not keep, and makes its output again
        sel_bw_tmp=[
            bw_tmp[k] + extra[k] - min(sel[k], extra[k]) + x[k + 1] + more[k] for k in range(n)
        ],
    )
