"""Measure a sequential model layer by layer: times, activation sizes, transient peaks.

The measurement runs on one sample batch and leaves no trace: random-number state and
module buffers (BatchNorm running statistics) are restored afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from tensorscope.checkpoint.chain import Chain
from tensorscope.checkpoint.tracker import StorageTracker
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["InPlaceLayerError", "LayerProfile", "Profile", "flatten", "measure"]

# NOTE [what is measured]
# For each layer k, fed the previous layer's output (computed without autograd):
#   x_sizes[k+1]   storage bytes of the output computed under no_grad (at least the bytes the
#                  forward left allocated); the storage, not the view, is what stays alive.
#   xbar_sizes[k+1] bytes left allocated by the forward with autograd while its output is held:
#                  output plus saved tensors that are new (a saved input is x_k, counted
#                  already; parameters are excluded); at least x_sizes[k+1].
#   fw_tmp[k]      the larger of the two forwards' peak above (input + their result).
#   bw_tmp[k]      peak of torch.autograd.grad(output, [input, *params], d) above everything
#                  it starts with plus the input gradient, not counting the parameter
#                  gradients (mem_limit excludes parameters and their gradients).
#   keeps_output   whether a tensor the forward saved for backward shares the output's storage
#                  (saved_tensors_hooks see every saved tensor): if not, the output dies once
#                  the next layer is done with it (NOTE [memory model] in simulate.py).
#   uses_rng       whether the forward changed the CPU (or CUDA) random state: only such
#                  layers need their state saved and replayed when recomputed.
#   fw[k], bw[k]   seconds of the forward with autograd and of that backward: the least of
#                  ``repeats`` untracked runs after the tracked one (CUDA: synchronized).
# Memory comes from StorageTracker on CPU (NOTE [storage accounting on CPU]) and from
# torch.cuda.memory_allocated / max_memory_allocated on CUDA, where parameter gradients cannot
# be told apart and stay counted in bw_tmp (conservative).


class InPlaceLayerError(InvalidArgumentError):
    """Layer ``index`` modified its input in place (checkpoints must not change)."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class LayerProfile:
    """What :func:`measure` found for one layer (sizes in bytes, times in seconds).

    Example:
        >>> import torch
        >>> layer = measure([torch.nn.ReLU()], torch.randn(4, 8), repeats=1).layers[0]
        >>> layer.x_nbytes, layer.xbar_nbytes, layer.keeps_output, layer.uses_rng
        (128, 128, True, False)
    """

    name: str
    fw_s: float
    bw_s: float
    x_nbytes: int
    xbar_nbytes: int
    fw_tmp_nbytes: int
    bw_tmp_nbytes: int
    uses_rng: bool = False
    keeps_output: bool = True
    offload_nbytes: int = 0
    offload_tensors: int = 0
    sel_nbytes: int = (
        0  # NOTE [selective recomputation]: what Fs keeps beyond the output (0: no Fs)
    )
    sel_covered: int = 0  # of it, what the replay's autograd saves (not made again)
    sel_share: float = 1.0  # the replay's time as a share of the forward's


@dataclass(frozen=True)
class Profile:
    """Per-layer measurements of a sequential model on one input.

    Example:
        >>> import torch
        >>> prof = measure([torch.nn.Linear(8, 8), torch.nn.ReLU()], torch.randn(4, 8))
        >>> prof.input_nbytes, [layer.x_nbytes for layer in prof.layers]
        (128, [128, 128])
    """

    input_nbytes: int
    layers: tuple[LayerProfile, ...]
    device: str

    def to_chain(self, loss_tmp: int = 0) -> Chain:
        """The :class:`Chain` the solver needs, in bytes and seconds."""
        ls = self.layers
        return Chain(
            [p.fw_s for p in ls],
            [p.bw_s for p in ls],
            [self.input_nbytes] + [p.x_nbytes for p in ls],
            [0] + [p.xbar_nbytes for p in ls],
            [p.fw_tmp_nbytes for p in ls],
            [p.bw_tmp_nbytes for p in ls],
            loss_tmp,
            keeps_output=[p.keeps_output for p in ls],
            # NOTE [selective recomputation] (simulate.py): Fs keeps the output and sel_nbytes;
            # B after it makes what autograd saves beyond sel_covered, and the output again
            xsel_sizes=[0]
            + [p.x_nbytes + p.sel_nbytes if p.sel_nbytes else p.xbar_nbytes for p in ls],
            sel_bw=[p.fw_s * p.sel_share for p in ls],
            sel_bw_tmp=[p.bw_tmp_nbytes + max(0, p.xbar_nbytes - p.sel_covered) for p in ls],
        )


def flatten(model: nn.Module) -> list[nn.Module]:
    """The layers of a ``nn.Sequential``, nested ``Sequential``s expanded in order.

    Raises:
        ArgumentTypeError: ``model`` is not an ``nn.Sequential``.

    Example:
        >>> seq = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
        >>> [type(m).__name__ for m in flatten(seq)]
        ['Linear', 'ReLU', 'Linear']
    """
    if isinstance(model, nn.ModuleList):
        # a list of blocks is looped over by its model's forward, which must keep running:
        # checkpoint_chain routes the blocks' calls instead of replacing a forward
        raise ArgumentTypeError(
            f"tensorscope.checkpoint: Checkpointable needs an nn.Sequential, got a ModuleList "
            f"of {len(model)} blocks. A list of blocks is checkpointed by passing it to "
            f"checkpoint_chain(model.model.layers, mem_limit=...) (or checkpoint_chain(model, "
            f"...), which finds it): it returns a handle with the same compute_sequence(), "
            f"explain() and schedule while the model's own forward runs."
        )
    if not isinstance(model, nn.Sequential):
        raise ArgumentTypeError(
            f"tensorscope.checkpoint: Checkpointable needs an nn.Sequential, got "
            f"{type(model).__name__}. For a model that calls a list of blocks in its own "
            f"forward (HF model.layers), use checkpoint_chain(model, mem_limit=...); otherwise "
            f"rewrite the forward as modules each taking and returning one tensor: "
            f"nn.Sequential(layer1, layer2, ...)."
        )
    out: list[nn.Module] = []
    for child in model:
        out.extend(flatten(child) if isinstance(child, nn.Sequential) else [child])
    return out


def _storage_nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


class Meter:
    """Live/peak bytes relative to a mark: StorageTracker on CPU, CUDA stats on CUDA (the
    measuring window of profile.py and of the block probe, blockprobe.py)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.tracker = None if self.cuda else StorageTracker()

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Count the storages made inside (the tracker pushed for the block only)."""
        with self.tracker if self.tracker is not None else nullcontext():
            yield

    @contextmanager
    def active(self) -> Iterator[None]:
        """As :meth:`tracking`, then stop watching the storages still alive."""
        with self.tracking():
            yield
        self.close()

    def close(self) -> None:
        """Stop watching the storages still alive."""
        if self.tracker is not None:
            self.tracker.close()

    def mark(self) -> int:
        if self.tracker is None:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return int(torch.cuda.memory_allocated(self.device))
        self.tracker.reset_peak()
        return self.tracker.live_nbytes

    def live(self) -> int:
        if self.tracker is None:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.memory_allocated(self.device))
        return self.tracker.live_nbytes

    def serial(self) -> int:
        """A mark for :meth:`made_since` (0 on CUDA, where storages are not counted)."""
        return self.tracker.serial if self.tracker is not None else 0

    def made_since(self, serial: int, key: int) -> bool:
        """Whether the live storage ``key`` was made after the mark ``serial`` (on CUDA:
        unknown, so True)."""
        if self.tracker is None:
            return True
        made = self.tracker.serial_of(key)
        return made is not None and made > serial

    def peak(self, exclude: Sequence[torch.Tensor] = ()) -> int:
        if self.tracker is None:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.tracker.window_peak(exclude)


def _params(layer: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in layer.parameters():
        if p.requires_grad:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _check_output(y: object, k: int, layer: nn.Module) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise ArgumentTypeError(
            f"tensorscope.checkpoint: layer {k} ({type(layer).__name__}) returned "
            f"{type(y).__name__}; every layer of a Checkpointable must map one tensor to one "
            f"tensor. Wrap multi-output parts in a module that returns a single tensor."
        )
    return y


@dataclass
class _Sizes:
    x_nbytes: int
    xbar_nbytes: int
    fw_tmp_nbytes: int
    bw_tmp_nbytes: int
    uses_rng: bool
    keeps_output: bool


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _measure_memory(k: int, layer: nn.Module, x: torch.Tensor, meter: Meter) -> _Sizes:
    version = x._version
    rng_before = _rng_state(x.device)
    base = meter.mark()
    with torch.no_grad():
        y = _check_output(layer(x), k, layer)
    uses_rng = not all(map(torch.equal, rng_before, _rng_state(x.device)))
    if x._version != version:
        raise InPlaceLayerError(
            f"tensorscope.checkpoint: layer {k} ({type(layer).__name__}) modifies its input in "
            f"place, which would corrupt a stored checkpoint. Use inplace=False, or fold it "
            f"into the previous layer inside a custom nn.Module.",
            k,
        )
    x_nbytes = max(_storage_nbytes(y), meter.live() - base)
    fw_tmp = max(0, meter.peak() - base - x_nbytes)
    del y

    grad_input = _differentiable(x)
    base = meter.mark()
    inp = x.detach().requires_grad_(grad_input)
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage()._cdata)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _check_output(layer(inp), k, layer)
    keeps_output = out.untyped_storage()._cdata in saved
    xbar_nbytes = max(meter.live() - base, x_nbytes)
    fw_tmp = max(fw_tmp, meter.peak() - base - xbar_nbytes)
    targets = ([inp] if grad_input else []) + _params(layer)
    bw_tmp = 0
    if out.requires_grad and targets:
        d = torch.ones_like(out)
        base = meter.mark()
        grads = torch.autograd.grad(out, targets, d, allow_unused=True)
        param_grads = [g for g in grads[1 if grad_input else 0 :] if g is not None]
        input_grad = x.nbytes if grad_input else 0
        bw_tmp = max(0, meter.peak(param_grads) - base - input_grad)
    return _Sizes(x_nbytes, xbar_nbytes, fw_tmp, bw_tmp, uses_rng, keeps_output)


def _differentiable(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def _measure_time(layer: nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Seconds of the forward with autograd, and of its backward: the least of ``repeats``
    runs, the best estimate of the undisturbed time on a busy machine."""
    device = x.device

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    grad_input = _differentiable(x)
    params = _params(layer)
    fw_s: list[float] = []
    bw_s: list[float] = []
    for _ in range(repeats):
        inp = x.detach().requires_grad_(grad_input)
        start = now()
        with torch.enable_grad():
            out = layer(inp)
        fw_s.append(now() - start)
        targets = ([inp] if grad_input else []) + params
        if out.requires_grad and targets:
            d = torch.ones_like(out)
            start = now()
            torch.autograd.grad(out, targets, d, allow_unused=True)
            bw_s.append(now() - start)
        else:
            bw_s.append(0.0)
    return min(fw_s), min(bw_s)


@contextmanager
def _no_trace(modules: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Restore RNG state, module buffers and training flags after measuring."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    flags = [(sub, sub.training) for m in modules for sub in m.modules()]
    try:
        for m in modules:
            m.train(True)
        yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        for sub, flag in flags:
            sub.training = flag
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def measure(
    layers: Sequence[nn.Module], sample_input: torch.Tensor, *, repeats: int = 3
) -> Profile:
    """Measure each layer of a chain on ``sample_input``, in training mode.

    Args:
        layers: the chain's layers, in order (see :func:`flatten`).
        sample_input: a typical batch (its size decides every activation size).
        repeats: timed runs per layer after the measured one; times are the least.

    Raises:
        ArgumentTypeError: a layer does not return a single tensor.
        InPlaceLayerError: a layer modifies its input in place.

    Example:
        >>> import torch
        >>> prof = measure([torch.nn.Linear(16, 16)], torch.randn(8, 16), repeats=1)
        >>> prof.to_chain().length
        1
    """
    if not isinstance(sample_input, torch.Tensor):
        raise ArgumentTypeError(
            f"tensorscope.checkpoint: the model input must be a tensor; got "
            f"{type(sample_input).__name__}"
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InvalidArgumentError(f"tensorscope.checkpoint: repeats must be >= 1; got {repeats!r}")
    device = sample_input.device
    meter = Meter(device)
    sizes: list[_Sizes] = []
    times: list[tuple[float, float]] = []
    with _no_trace(layers, device):
        # Memory first, tracked; then times, untracked (the tracker costs microseconds per op).
        with meter.active():
            x = sample_input.detach()
            for k, layer in enumerate(layers):
                sizes.append(_measure_memory(k, layer, x, meter))
                with torch.no_grad():
                    x = layer(x)
        x = sample_input.detach()
        for layer in layers:
            times.append(_measure_time(layer, x, repeats))
            with torch.no_grad():
                x = layer(x)
    profiles = tuple(
        LayerProfile(type(layer).__name__, t[0], t[1], *vars(s).values())
        for layer, s, t in zip(layers, sizes, times, strict=True)
    )
    return Profile(_storage_nbytes(sample_input), profiles, str(device))
