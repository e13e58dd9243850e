"""``tensorscope demo``: memory saved versus plain PyTorch, measured on this machine.

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
"""

from __future__ import annotations

import json
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


def _progress(total: int, label: str, show: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the demo extra
        return _NoProgress()
    return tqdm(total=total, desc=f"{label:>13}", disable=not show, leave=False, unit="batch")


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _run_in_subprocess(variant: str, batches: int) -> LeakRun:
    code = (
        "import json, sys, dataclasses\n"
        "from tensorscope.demo import run_leak_variant\n"
        f"run = run_leak_variant({variant!r}, {batches}, show_progress=True)\n"
        "print(json.dumps(dataclasses.asdict(run)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, stdout=subprocess.PIPE, text=True
    )
    return LeakRun(**json.loads(done.stdout.strip().splitlines()[-1]))


def main(batches: int = 40) -> int:
    """Run part 1 of the demo and print a side-by-side table. Returns a process exit code."""
    from tensorscope._units import format_bytes

    print("tensorscope demo, part 1: dispose scopes vs a leaking evaluation loop")
    print(
        f"  model 1024-4096-4096-10, batch 256, {batches} batches, torch.no_grad() forgotten,\n"
        "  every batch's logits kept for metrics (each one pins its autograd graph)\n"
    )
    variants = ("plain", "plain-fixed", "scoped", "scoped-fixed")
    runs = [_run_in_subprocess(v, batches) for v in variants]
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
    print(
        f"\n  logits still usable after the loop: {', '.join(str(r.kept) for r in runs)} "
        "(the scope disposes what was not moved out of it)"
    )
    if runs[2].leak_report:
        first = runs[2].leak_report[0].splitlines()
        print("\n  the leak report of the scoped run (first batch):")
        for line in first:
            print(f"    {line}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
