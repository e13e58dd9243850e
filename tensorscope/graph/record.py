"""Record the ops of an iteration and detect where iterations begin.

An iteration ends at an explicit boundary (the manager calls :meth:`Recorder.boundary` after
each optimizer step) or when the op that began the previous iteration comes again: the same
function touching the same tensors, which is how a repeated forward (inference) looks.
A trace that diverges from its predecessor stops predicting until the next boundary; the next
iteration is recorded afresh. Pure Python: keys are opaque hashables.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from tensorscope.graph.analysis import NextUse

__all__ = ["Recorder", "Trace"]

_MIN_ITERATION_OPS = 4
# A workload that never repeats must not grow the trace forever: past this many ops the
# iteration is cut (predictions from it are then merely unhelpful, never wrong).
MAX_ITERATION_OPS = 200_000


@dataclass
class Trace:
    """The ops of one iteration: ``signatures[i]`` names op i, ``keys[i]`` what it touched."""

    signatures: list[Hashable] = field(default_factory=list)
    keys: list[tuple[Hashable, ...]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # the caller's clock when each op began

    def __len__(self) -> int:
        return len(self.keys)


class Recorder:
    """Keeps the current iteration's trace and the previous one, aligned by op index.

    Example:
        >>> r = Recorder()
        >>> for _ in range(2):
        ...     for name, keys in [("mm", ("w1",)), ("relu", ()), ("mm", ("w2",)), ("add", ()),
        ...                        ("sum", ())]:
        ...         r.record(name, keys)
        >>> r.iterations, r.predicting, r.position
        (1, True, 4)
    """

    def __init__(self) -> None:
        self.current = Trace()
        self.previous: NextUse | None = None
        self._previous_signatures: list[Hashable] = []
        self._previous_times: list[float] = []
        self.iterations = 0  # completed iterations
        self.diverged = False

    @property
    def position(self) -> int:
        """Index of the last recorded op in the current iteration (-1 before the first)."""
        return len(self.current) - 1

    @property
    def predicting(self) -> bool:
        """Whether the previous iteration predicts this one (recorded and not diverged)."""
        return self.previous is not None and not self.diverged

    def starts_iteration(self, signature: Hashable, keys: tuple[Hashable, ...]) -> bool:
        trace = self.current
        return (
            len(trace) >= _MIN_ITERATION_OPS
            and signature == trace.signatures[0]
            and keys == trace.keys[0]
        )

    def record(self, signature: Hashable, keys: tuple[Hashable, ...], at: float = 0.0) -> None:
        """Append one op (starting a new iteration first if it is the start of the last one);
        ``at``: the caller's clock (seconds) when the op began, for :meth:`seconds_until`."""
        if self.starts_iteration(signature, keys) or len(self.current) >= MAX_ITERATION_OPS:
            self.boundary()
        index = len(self.current)
        if self.previous is not None and not self.diverged:
            expected = self._previous_signatures
            if index >= len(expected) or expected[index] != signature:
                self.diverged = True
        self.current.signatures.append(signature)
        self.current.keys.append(keys)
        self.current.times.append(at)

    def record_many(
        self,
        signatures: list[Hashable],
        keys: list[tuple[Hashable, ...]],
        times: list[float],
    ) -> list[int]:
        """``record()`` of each op in turn, in bulk; returns the indices of the ops that began
        a new iteration (where the caller's per-iteration work goes).

        Example:
            >>> r, s = Recorder(), Recorder()
            >>> ops = ["a", "b", "c", "d", "e"] * 3
            >>> for op in ops:
            ...     r.record(op, ())
            >>> s.record_many(ops, [()] * 15, [0.0] * 15)
            [5, 10]
            >>> (r.iterations, r.position, r.diverged) == (s.iterations, s.position, s.diverged)
            True
        """
        starts: list[int] = []
        count = len(signatures)
        done = 0
        while done < count:
            trace = self.current
            # The next op that begins an iteration: the trace's first op again (with at least
            # _MIN_ITERATION_OPS recorded), or the cut at MAX_ITERATION_OPS.
            end = min(count, done + MAX_ITERATION_OPS - len(trace))
            if len(trace) > 0:
                first_signature, first_keys = trace.signatures[0], trace.keys[0]
                skip = max(done, done + _MIN_ITERATION_OPS - len(trace))
                for index in range(skip, end):
                    if signatures[index] == first_signature and keys[index] == first_keys:
                        end = index
                        break
            else:  # a fresh trace: its first op is this one
                first_signature, first_keys = signatures[done], keys[done]
                for index in range(done + _MIN_ITERATION_OPS, end):
                    if signatures[index] == first_signature and keys[index] == first_keys:
                        end = index
                        break
            if end == done:  # this op begins an iteration
                self.boundary()
                starts.append(done)
                end = min(count, done + 1)
                self._extend(signatures, keys, times, done, end)
            else:
                self._extend(signatures, keys, times, done, end)
            done = end
        return starts

    def _extend(
        self,
        signatures: list[Hashable],
        keys: list[tuple[Hashable, ...]],
        times: list[float],
        start: int,
        end: int,
    ) -> None:
        trace = self.current
        index = len(trace)
        if self.previous is not None and not self.diverged:
            expected = self._previous_signatures[index : index + end - start]
            if expected != signatures[start:end]:
                self.diverged = True
        trace.signatures.extend(signatures[start:end])
        trace.keys.extend(keys[start:end])
        trace.times.extend(times[start:end])

    def boundary(self) -> None:
        """End the current iteration: it becomes the prediction for the next one."""
        if len(self.current) == 0:
            return
        self.previous = NextUse(self.current.keys)
        self._previous_signatures = self.current.signatures
        self._previous_times = self.current.times
        self.current = Trace()
        self.iterations += 1
        self.diverged = False

    def next_use(self, key: Hashable) -> int | None:
        """Predicted op index (in this iteration) at which ``key`` is used next, or None."""
        if self.previous is None or self.diverged:
            return None
        return self.previous.after(key, self.position)

    def seconds_until(self, index: int) -> float | None:
        """Clock seconds the previous iteration took from this op's position to op ``index``:
        how soon op ``index`` of this iteration is expected; None without a prediction.

        Example:
            >>> r = Recorder()
            >>> for it in range(2):
            ...     for i, name in enumerate(["a", "b", "c", "d", "e"]):
            ...         r.record(name, (), at=10.0 * it + i * 0.5)
            >>> r.position, r.seconds_until(4)
            (4, None)
            >>> r.record("a", (), at=20.0); r.seconds_until(3)
            1.5
        """
        times = self._previous_times
        position = self.position
        if self.previous is None or self.diverged or not 0 <= position < index < len(times):
            return None
        return times[index] - times[position]

    def upcoming(self, limit: int, through: int = -1) -> list[Hashable]:
        """Keys the previous iteration used next, in order: at most ``limit``, or all those
        used up to op index ``through``."""
        if self.previous is None or self.diverged:
            return []
        return self.previous.upcoming(self.position, limit, through)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]
