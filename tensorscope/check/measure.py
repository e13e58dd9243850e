"""Measuring on the check's device: the caching allocator's counters, cuBLAS's workspaces,
synchronised timing, and the models the checks run (GPT-2 shapes from configs, random weights).

# NOTE [cuBLAS workspaces]
# cuBLAS gets a workspace (32 MiB on Hopper) through the caching allocator the first time a
# thread's handle runs a GEMM on a stream, and keeps it: ``memory_allocated`` counts it, no
# tensor holds it, so neither a scope nor the recorder ever sees it. Autograd runs a CUDA
# backward on its own device thread, whose handle gets a workspace of its own: a warm-up needs
# a matmul forward *and* backward. ``torch._C._cuda_clearCublasWorkspaces()`` gives them back;
# the drop in ``memory_allocated`` is their size (``workspace_bytes``), and the next GEMM makes
# them again.

Layer: the check package; imports torch, transformers (lazily) and tensorscope's public face.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "allocator",
    "gpt2",
    "median_seconds",
    "profiler_peak",
    "sync",
    "tokens",
    "warm_up",
    "workspace_bytes",
]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocator(device: torch.device) -> dict[str, int]:
    """The caching allocator's counters (bytes) after a synchronisation; {} on the CPU."""
    if device.type != "cuda":
        return {}
    sync(device)
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "max_reserved": torch.cuda.max_memory_reserved(device),
    }


def warm_up(device: torch.device) -> None:
    """A matmul forward and backward, so that cuBLAS's workspaces of this thread and of
    autograd's device thread exist before a baseline is taken (NOTE [cuBLAS workspaces])."""
    a = torch.randn(64, 64, device=device, requires_grad=True)
    torch.autograd.backward((a @ a).sum())
    del a
    sync(device)


def workspace_bytes(device: torch.device) -> int:
    """Bytes of cuBLAS workspaces the allocator holds now, given back (they come again with the
    next GEMM); 0 on the CPU or where torch cannot clear them."""
    if device.type != "cuda":
        return 0
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return 0
    sync(device)
    before = torch.cuda.memory_allocated(device)
    clear()
    sync(device)
    return before - torch.cuda.memory_allocated(device)


def median_seconds(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median wall seconds of ``repeats`` synchronised calls of ``run``."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpt2(
    layers: int, width: int, heads: int, vocab: int, positions: int, device: torch.device
) -> torch.nn.Module:
    """A GPT-2 language model of this shape with random weights (seeded), on ``device``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocab,
        n_positions=positions,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model: torch.nn.Module = GPT2LMHeadModel(config)
    return model


def tokens(
    batch: int, length: int, vocab: int, device: torch.device, seed: int = 1
) -> torch.Tensor:
    """A batch of random token ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator).to(device)


def profiler_peak(step: Callable[[], None]) -> int:
    """The CPU allocator's highest total during ``step`` as torch's profiler reports it
    (``profile_memory=True``): a reference independent of tensorscope's recording."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    peak = 0
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        if event.tag == _EventType.Allocation:
            peak = max(peak, event.extra_fields.total_allocated)
        todo.extend(event.children)
    return peak
