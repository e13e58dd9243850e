"""Selective recomputation of a block: keep its expensive ops' results, replay the rest.

NOTE [selective recomputation] (simulate.py) says what ``Fs`` is to the schedule; this module
is its torch side. ``Fs(k)`` runs the block without autograd under :class:`Keep`, which keeps
the results of the ops in :data:`KEPT` -- matrix products, convolutions, fused attention and
random draws -- in call order. ``B(k)`` replays the forward with autograd under
:class:`Replay`: each kept op returns its kept result instead of running (a random draw in
place writes it into its argument), every other op runs again. The same as torch's selective
activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with
the policy "save matmuls and random ops", with the choice of *which blocks* left to rotor's DP.

Why these ops: on GPT-2 8x256 (CPU) a block's forward spends 41% of its time in matrix products
and 32% drawing dropout masks, and keeping their results is 40 MiB of the 87 MiB autograd saves:
the replay then takes 16 ms where recomputing the block takes 56 ms. Keeping random draws also
makes the replay independent of the random state (their results are not drawn again).

The replay checks each kept op against the one it stands in for (the op and its tensor
arguments' shapes); a block whose forward took another path raises :class:`Diverged`, and
the caller recomputes it whole, its random state replayed (blockrun.py): slower, never wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tensorscope._modes import DispatchMode
from tensorscope.checkpoint.calls import storage_key

__all__ = ["KEPT", "Diverged", "Keep", "Replay", "SelectiveMeter", "kept"]

_aten = torch.ops.aten

_KEPT_NAMES = (
    # matrix products and convolutions: most of a block's time
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm",
    "convolution", "_convolution", "convolution_overrideable", "mkldnn_convolution",
    "cudnn_convolution", "miopen_convolution",
    # fused attention
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
    # random draws: slow on the CPU (dropout masks), and the replay must not draw again
    "bernoulli", "bernoulli_", "native_dropout", "rand", "rand_like", "randn", "randn_like",
    "randint", "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "random_", "multinomial",
)  # fmt: skip

#: The op packets whose results ``Fs`` keeps.
KEPT: frozenset[Any] = frozenset(
    getattr(_aten, name) for name in _KEPT_NAMES if hasattr(_aten, name)
)


def kept(func: Any) -> bool:
    """Whether ``Fs`` keeps the result of ``func`` (an ATen overload).

    Example:
        >>> kept(torch.ops.aten.mm.default), kept(torch.ops.aten.gelu.default)
        (True, False)
    """
    return func.overloadpacket in KEPT


def _signature(func: Any, args: Iterable[Any]) -> tuple[Any, ...]:
    return (func, *(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))


class Diverged(RuntimeError):
    """The replay met another op than the kept one at its place: the block's forward took
    another path (data-dependent control flow)."""


def _mutates_first(func: Any) -> bool:
    schema = func._schema
    return (
        bool(schema.arguments)
        and schema.arguments[0].alias_info is not None
        and bool(schema.arguments[0].alias_info.is_write)
    )


class Keep(DispatchMode):
    """``Fs``'s forward: the results of the kept ops, in call order (an in-place draw's result
    copied: later in-place ops change its tensor, as dropout's ``div_`` does)."""

    eager_under_compile = True  # every op seen (NOTE [our modes and torch.compile])

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.results: list[tuple[tuple[Any, ...], Any]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in KEPT:
            # an alias of its own: the replay's autograd sets its history on what it returns,
            # never on a tensor the forward handed on (a block's output can be a kept result)
            value = out.clone() if _mutates_first(func) else _detached(out)
            self.results.append((_signature(func, args), value))
        return out

    def nbytes(self) -> int:
        """Bytes of the kept results (each storage once)."""
        seen: dict[Any, int] = {}
        for _, value in self.results:
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    seen[storage_key(t)] = int(t.untyped_storage().nbytes())
        return sum(seen.values())


class Replay(DispatchMode):
    """``B(k)``'s replay: each kept op answered from ``results`` (consumed: the list gives its
    references up as it goes, so the replay's graph is what holds them after)."""

    eager_under_compile = True  # every op seen (NOTE [our modes and torch.compile])

    def __init__(self, results: list[tuple[tuple[Any, ...], Any]]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.results = results
        self.at = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func.overloadpacket not in KEPT:
            return func(*args, **(kwargs or {}))
        if self.at >= len(self.results):
            raise Diverged(f"{func} has no kept result (the forward took another path)")
        signature, value = self.results[self.at]
        if signature != _signature(func, args):
            raise Diverged(f"{func} met where {signature[0]} was kept")
        self.results[self.at] = (signature, None)
        self.at += 1
        if _mutates_first(func):
            args[0].copy_(value)
            return args[0]
        return value

    def finish(self) -> None:
        """Every kept result must have been used."""
        if self.at != len(self.results):
            raise Diverged(f"{len(self.results) - self.at} kept results were not used")


class SelectiveMeter(DispatchMode):
    """In the measuring step, around a block's forward with autograd: the bytes ``Fs`` would
    keep (``kept_nbytes``), how many of them the forward's autograd saves as they are
    (``covered_nbytes``: the replay makes those no second time; ``saved`` is called from the
    pack hook) and the share of the forward's op time that a replay runs again
    (``replay_share``). Storages are known by key, and a key seen again as another op's output
    is a new storage at a freed one's address: the old one is forgotten then."""

    eager_under_compile = True  # every op seen (NOTE [our modes and torch.compile])

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kept_nbytes = 0
        self.live: dict[Any, int] = {}  # kept results still alive (not written in place)
        self.covered: dict[Any, int] = {}
        self.kept_s = 0.0
        self.other_s = 0.0
        self.synchronize = synchronize

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        sync = self.synchronize
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if sync is not None:
            sync()
        elapsed = time.perf_counter() - start
        is_kept = func.overloadpacket in KEPT
        if is_kept:
            self.kept_s += elapsed
        else:
            self.other_s += elapsed
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            key = storage_key(t)
            if not is_kept:
                if key in self.live and not (args and _aliases(args[0], key)):
                    del self.live[key]  # a new storage where a kept one was freed
                continue
            nbytes = int(t.untyped_storage().nbytes())
            self.kept_nbytes += nbytes
            if _mutates_first(func):
                self.live.pop(key, None)  # the replay writes it into a tensor of its own
            else:
                self.live[key] = nbytes
        return out

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saves ``t`` (the probe's pack hook)."""
        key = storage_key(t)
        if key in self.live:
            self.covered[key] = self.live[key]

    def forget(self, key: Any) -> int:
        """Leave the storage ``key`` out (the block's output, which Fs keeps anyway); its
        bytes if it was kept."""
        self.covered.pop(key, None)
        return self.live.pop(key, 0)

    @property
    def covered_nbytes(self) -> int:
        return sum(self.covered.values())

    @property
    def replay_share(self) -> float:
        total = self.kept_s + self.other_s
        return self.other_s / total if total > 0 else 1.0


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(t) for t in out)
    return out


def _aliases(arg: Any, key: Any) -> bool:
    return isinstance(arg, torch.Tensor) and storage_key(arg) == key
