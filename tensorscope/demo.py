"""``tensorscope demo``: memory saved versus plain PyTorch, measured on this machine.

Part 2 (residency) runs a 134M-parameter transformer language model (537 MiB of fp32 weights,
pure torch, random weights) for inference three ways, each in a fresh subprocess: plain, and with
``ts.manage(model)`` under a device budget of 25% of the weights with the Flow and Genoa
policies; it prints time per forward and peak RSS above the RSS before the model was built, and
checks the outputs are equal.

Part 1 (dispose scopes): an evaluation loop with the classic leak — it forgets
``torch.no_grad()`` and keeps every batch's logits for metrics, so each kept tensor holds its
whole autograd graph, activations included. It runs three ways, each in a fresh subprocess so
that one run's allocator state cannot flatter another's:

1. plain PyTorch: memory grows with every batch;
2. plain PyTorch with the usual fix, ``all_logits.append(logits.detach())``;
3. the leaking loop unchanged but for ``with ts.scope(report_leaks=True):`` around each batch:
   memory stays flat, and the leak report names the line that kept the tensors;
4. the scoped loop keeping what the metrics need explicitly
   (``logits.detach().detach_from_scope()``).

Variants 2 and 4 keep 40 small tensors between 4 MiB activations, which fragments glibc's heap:
their RSS stays above the plain leak-free minimum for that reason alone (the same in both).

Peak RSS is sampled every 2 ms on a background thread and reported above the RSS measured once
the model is built and warmed up.

# NOTE [a demo that fits a log]
# On a terminal each variant shows a tqdm bar; anywhere else (CI, ``| tee``, a file) a bar would
# write thousands of carriage-return updates into the log, so each variant prints one line when
# it ends instead. Times measured while other work competes for the cores mean little (a loaded
# 2-core machine once showed plain PyTorch at 12.3 s/forward and the managed run at 0.55 s):
# when the 1-minute load average exceeds the number of cores, each table says that its times
# are unreliable (its memory figures are not affected).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

__all__ = ["LeakRun", "main", "run_leak_variant"]


@dataclass(frozen=True)
class LeakRun:
    variant: str
    batches: int
    peak_above_baseline_bytes: int
    seconds: float
    kept: int
    leak_report: list[str]


def run_leak_variant(variant: str, batches: int, show_progress: bool) -> LeakRun:
    """Run one variant of the leaky evaluation loop in this process."""
    import torch
    from torch import nn

    import tensorscope as ts
    from tensorscope.memory import PeakRSS, rss_bytes

    torch.manual_seed(0)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = nn.Sequential(
        nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)
    )
    data = [torch.randn(256, 1024) for _ in range(4)]
    model(data[0]).sum().backward()  # warm up allocator and kernels
    model.zero_grad(set_to_none=True)
    all_logits: list[torch.Tensor] = []
    report: list[str] = []
    baseline = rss_bytes()
    progress = _progress(batches, variant, show_progress)
    start = time.perf_counter()
    with PeakRSS(baseline_bytes=baseline) as peak, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ts.LeakWarning)
        for i in range(batches):
            scoped = variant.startswith("scoped")
            context = ts.scope(name="eval", report_leaks=(i == 0)) if scoped else nullcontext()
            with context:
                logits = model(data[i % len(data)])  # forgot torch.no_grad(): a graph per batch
                if variant == "scoped-fixed":
                    all_logits.append(logits.detach().detach_from_scope())
                elif variant == "plain-fixed":
                    all_logits.append(logits.detach())
                else:
                    all_logits.append(logits)  # the leak: each kept tensor pins its graph
            peak.sample()
            progress.update(1)
    seconds = time.perf_counter() - start
    progress.close()
    for warning in caught:
        if issubclass(warning.category, ts.LeakWarning):
            report.append(str(warning.message))
    kept = sum(1 for t in all_logits if not getattr(t, "is_disposed", False))
    return LeakRun(variant, batches, peak.peak_above_baseline_bytes, seconds, kept, report)


def _progress(total: int, label: str, show: bool, unit: str = "batches") -> Any:
    """A tqdm bar on a terminal; elsewhere one line when the work ends (see the NOTE above)."""
    if not show:
        return _NoProgress()
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is in the demo extra
            pass
        else:
            return tqdm(total=total, desc=f"{label:>13}", leave=False, unit=unit)
    return _LineProgress(total, label, unit)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _LineProgress:
    """Progress for a log: a single line on stderr when the work is closed."""

    def __init__(self, total: int, label: str, unit: str) -> None:
        self.total, self.label, self.unit = total, label, unit
        self.done = 0
        self.start = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n

    def close(self) -> None:
        seconds = time.perf_counter() - self.start
        print(
            f"  {self.label}: {self.done}/{self.total} {self.unit}, {seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def _load_note(loads: list[float], cores: int | None = None) -> str | None:
    """What to say under a table of times measured while the 1-minute load averages ``loads``
    were seen: nothing on a machine that had a core per runnable thread, else that the times are
    unreliable."""
    cores = cores or os.cpu_count() or 1
    worst = max(loads, default=0.0)
    if worst <= cores:
        return None
    return (
        f"  note: this machine was loaded (load average up to {worst:.1f} on {cores} cores): "
        "the times and their ratios are unreliable; the memory figures are not affected"
    )


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - Windows, or no /proc/loadavg
        return 0.0


def _run_in_subprocess(call: str) -> dict[str, Any]:
    code = (
        "import json, sys, dataclasses\n"
        "from tensorscope import demo\n"
        f"run = demo.{call}\n"
        "print(json.dumps(dataclasses.asdict(run)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, stdout=subprocess.PIPE, text=True
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@dataclass(frozen=True)
class OffloadRun:
    variant: str
    weight_bytes: int
    seconds_per_forward: float
    peak_above_baseline_bytes: int
    output_checksum: list[float]
    report: str


def _language_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    width, vocab = 768, 32000
    layers = [
        nn.TransformerEncoderLayer(width, 12, 4 * width, dropout=0.0, batch_first=True)
        for _ in range(12)
    ]
    return nn.Sequential(
        nn.Embedding(vocab, width), *layers, nn.LayerNorm(width), nn.Linear(width, vocab)
    ).eval()


def run_offload_variant(variant: str, forwards: int, show_progress: bool) -> OffloadRun:
    """Inference with a 537 MiB model: plain, or managed at 25% of the weights (this process)."""
    import statistics

    import torch

    import tensorscope as ts
    from tensorscope.memory import PeakRSS, rss_bytes

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tokens = torch.randint(0, 32000, (1, 128), generator=torch.Generator().manual_seed(1))
    baseline = rss_bytes()
    model = _language_model()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    handle = None
    if variant != "plain":
        ts.residency.configure(device="cpu", policy=variant, budget=weight_bytes // 4)
        handle = ts.manage(model)
    times: list[float] = []
    progress = _progress(forwards + 2, variant, show_progress, unit="forwards")
    with torch.no_grad(), PeakRSS(baseline_bytes=baseline) as peak:
        for i in range(forwards + 2):  # two warm-up forwards: Flow learns the op order
            start = time.perf_counter()
            out = model(tokens)
            if i >= 2:
                times.append(time.perf_counter() - start)
            progress.update(1)
    progress.close()
    report = str(ts.residency.report()) if handle is not None else ""
    if handle is not None:
        handle.remove()
    checksum = [float(out.sum()), float(out.abs().sum()), float(out[0, -1, :8].sum())]
    return OffloadRun(
        variant,
        weight_bytes,
        statistics.median(times),
        peak.peak_above_baseline_bytes,
        checksum,
        report,
    )


def _part_offload(forwards: int) -> None:
    from tensorscope._units import format_bytes

    print("\ntensorscope demo, part 2: a model under a device budget of 25% of its weights")
    loads = [_load_average()]
    runs = []
    for v in ("plain", "flow", "genoa"):
        runs.append(
            OffloadRun(**_run_in_subprocess(f"run_offload_variant({v!r}, {forwards}, True)"))
        )
        loads.append(_load_average())
    plain = runs[0]
    print(
        f"  transformer LM, 12 layers d=768, vocab 32000: {format_bytes(plain.weight_bytes)} of "
        f"fp32 weights; budget {format_bytes(plain.weight_bytes // 4)}; batch 1 x 128 tokens\n"
    )
    print(
        f"  {'variant':<22}{'s/forward':>10}{'vs plain':>10}"
        f"{'peak RSS above baseline':>26}{'% of weights':>14}{'same output':>13}"
    )
    for run in runs:
        same = all(
            abs(a - b) <= 1e-3 * max(1.0, abs(b))
            for a, b in zip(run.output_checksum, plain.output_checksum, strict=True)
        )
        label = "plain PyTorch" if run.variant == "plain" else f"ts.manage, {run.variant}"
        print(
            f"  {label:<22}{run.seconds_per_forward:>9.3f}s"
            f"{run.seconds_per_forward / plain.seconds_per_forward:>9.2f}x"
            f"{format_bytes(run.peak_above_baseline_bytes):>26}"
            f"{run.peak_above_baseline_bytes / run.weight_bytes:>13.0%}"
            f"{'yes' if same else 'NO':>13}"
        )
    note = _load_note(loads)
    if note is not None:
        print(note)
    print("\n  the residency report of the Flow run:")
    for line in runs[1].report.splitlines():
        print(f"    {line}")


def main(batches: int = 40, forwards: int = 3, parts: str = "all") -> int:
    """Run the demo and print side-by-side tables. Returns a process exit code."""
    if parts in ("all", "scopes"):
        _part_scopes(batches)
    if parts in ("all", "offload"):
        _part_offload(forwards)
    return 0


def _part_scopes(batches: int) -> None:
    from tensorscope._units import format_bytes

    print("tensorscope demo, part 1: dispose scopes vs a leaking evaluation loop")
    print(
        f"  model 1024-4096-4096-10, batch 256, {batches} batches, torch.no_grad() forgotten,\n"
        "  every batch's logits kept for metrics (each one pins its autograd graph)\n"
    )
    variants = ("plain", "plain-fixed", "scoped", "scoped-fixed")
    loads = [_load_average()]
    runs = []
    for v in variants:
        runs.append(
            LeakRun(**_run_in_subprocess(f"run_leak_variant({v!r}, {batches}, show_progress=True)"))
        )
        loads.append(_load_average())
    labels = {
        "plain": "plain PyTorch (the leak)",
        "plain-fixed": "plain, fixed by hand: .detach()",
        "scoped": "leak unchanged, in ts.scope()",
        "scoped-fixed": "ts.scope() + detach_from_scope()",
    }
    plain_peak = max(runs[0].peak_above_baseline_bytes, 1)
    print(f"  {'variant':<34}{'peak RSS above baseline':>24}{'vs plain':>10}{'time':>9}")
    for run in runs:
        ratio = run.peak_above_baseline_bytes / plain_peak
        print(
            f"  {labels[run.variant]:<34}{format_bytes(run.peak_above_baseline_bytes):>24}"
            f"{ratio:>9.1%}{run.seconds:>8.2f}s"
        )
    note = _load_note(loads)
    if note is not None:
        print(note)
    print(
        f"\n  logits still usable after the loop: {', '.join(str(r.kept) for r in runs)} "
        "(the scope disposes what was not moved out of it)"
    )
    if runs[2].leak_report:
        first = runs[2].leak_report[0].splitlines()
        print("\n  the leak report of the scoped run (first batch):")
        for line in first:
            print(f"    {line}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
