"""Shared helpers of the offload benchmarks (``offload_inference.py``, ``offload_training.py``).

Each variant of a benchmark runs in a fresh subprocess (the same script with ``--worker``), so
the allocator state, the page cache mappings and the RSS of one variant never flatter another.
A worker prints one result line, ``RESULT_MARKER`` followed by JSON, on stdout; its stderr (the
residency report, warnings) passes straight through to the parent's stderr.

The scripts are run as files (``python benchmarks/offload_inference.py``): ``sys.path[0]`` is
then ``benchmarks/``, so this module imports by name and ``tensorscope`` resolves to the
installed (editable) package, not to a checkout in the current directory.

Reading the memory columns: RSS counts file-backed pages of mappings too, so the scripts also
report ``anon`` (RSS minus shared pages: what malloc holds). glibc raises its mmap threshold
(up to 32 MiB) each time a mmapped block is freed, so blocks of up to 32 MiB that are freed
afterwards stay in the heap and keep counting in RSS. The workers inherit the environment: running
a benchmark with ``MALLOC_MMAP_THRESHOLD_=65536`` (a fixed threshold) shows how much of a peak
is such retained heap rather than live tensors (at some cost in time in every variant).
"""

from __future__ import annotations

import os

# Never reach a hub: every model is built from a config with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import gc
import hashlib
import json
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
RESULT_MARKER = "@@offload-bench-result@@ "


# --------------------------------------------------------------------------- memory


def _process() -> Any:
    import psutil

    return psutil.Process()


def rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    return int(_process().memory_info().rss)


def rss_and_anon() -> tuple[int, int]:
    """(RSS, RSS - shared) of this process in bytes; "shared" counts file-backed pages."""
    info = _process().memory_info()
    return int(info.rss), int(info.rss) - int(getattr(info, "shared", 0))


def rss_breakdown() -> dict[str, int]:
    """``RssAnon`` / ``RssFile`` / ``RssShmem`` of this process in bytes (Linux; {} elsewhere)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    key, value, _unit = line.split()
                    out[key.rstrip(":")] = int(value) * 1024
    except OSError:
        pass
    return out


def warm_up_runtime() -> None:
    """Run one small matmul and one elementwise op before a baseline is taken.

    The first compute of a process starts the OpenMP threads and initialises MKL/oneDNN (tens of
    MiB of stacks and scratch). Every variant pays it, it does not depend on the model, so it
    belongs to the baseline, not to the variant's memory.
    """
    import torch

    a = torch.randn(256, 1024)
    (a @ torch.randn(1024, 1024)).tanh_().sum().item()


def settle_memory() -> None:
    """Collect garbage so a baseline is not inflated by objects that are already dead."""
    gc.collect()
    gc.collect()


class PeakSampler:
    """Sample this process's RSS every ``interval_s`` on a background thread, while entered.

    One sampler can be entered many times (once per forward or step): the peaks accumulate, so
    the result is the peak over the measured windows only, not over the work in between.
    Besides the total RSS it tracks the peak of ``rss - shared`` (anonymous memory: tensors
    allocated with malloc), since file-backed pages of a mapping count in RSS too.
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak_rss = 0
        self.peak_anon = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = _process()

    def sample(self) -> None:
        info = self._proc.memory_info()
        rss = int(info.rss)
        anon = rss - int(getattr(info, "shared", 0))
        self.samples += 1
        if rss > self.peak_rss:
            self.peak_rss = rss
        if anon > self.peak_anon:
            self.peak_anon = anon

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakSampler:
        self.sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="offload-bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sample()


# --------------------------------------------------------------------------- CPU contention
# The machine is shared: other jobs steal cores, and a timing means little without knowing how
# much. Each measured window records this process's CPU seconds (all its threads) and the CPU
# seconds the rest of the system used meanwhile ("others": /proc/stat busy time minus ours).


def _clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 100


_TICKS = _clock_ticks()


def system_busy_s() -> float | None:
    """CPU seconds all CPUs spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICKS


class Window:
    """Wall seconds, this process's CPU seconds, other processes' CPU seconds of a block."""

    def __init__(self) -> None:
        self.wall = self.cpu = self.others = 0.0

    def __enter__(self) -> Window:
        self._b0 = system_busy_s()
        self._c0 = time.process_time()
        self._w0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._w0
        self.cpu = time.process_time() - self._c0
        b1 = system_busy_s()
        if self._b0 is not None and b1 is not None:
            # /proc/stat counts in clock ticks (10 ms): clamp the rounding below zero.
            self.others = max(0.0, (b1 - self._b0) - self.cpu)


def others_cores(probe_s: float = 1.0) -> float | None:
    """CPU cores the other processes use, measured over ``probe_s`` seconds (we sleep)."""
    with Window() as w:
        time.sleep(probe_s)
    return None if system_busy_s() is None else w.others / w.wall


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.25) -> float | None:
    """Wait up to ``max_wait_s`` until others use < ``threshold_cores`` for 2 s in a row."""
    deadline = time.monotonic() + max_wait_s
    quiet_in_a_row = 0
    while True:
        load = others_cores()
        if load is None:
            return None
        quiet_in_a_row = quiet_in_a_row + 1 if load < threshold_cores else 0
        if quiet_in_a_row >= 2 or time.monotonic() >= deadline:
            return load


# --------------------------------------------------------------------------- tensors


def unique_tensors(module: Any) -> list[tuple[str, Any]]:
    """(name, tensor) of the module's parameters and buffers, each storage once (tied weights)."""
    seen: set[int] = set()
    out: list[tuple[str, Any]] = []
    named = list(module.named_parameters(remove_duplicate=False))
    named += list(module.named_buffers(remove_duplicate=False))
    for name, t in named:
        key = id(t)
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


def tensor_bytes(module: Any) -> int:
    """Bytes of the module's parameters and buffers (tied tensors counted once)."""
    return sum(t.numel() * t.element_size() for _, t in unique_tensors(module))


def state_checksum(module: Any) -> str:
    """blake2b over names, dtypes, shapes and bytes of the state dict, in key order."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=False).items():
            plain = t.detach()
            if plain.device.type == "meta":
                raise RuntimeError(f"state_checksum: {name} is on the meta device")
            # A tensor subclass (a managed ref) may not export its buffer: hash its plain target.
            if type(plain) is not torch.Tensor:
                plain = getattr(plain, "target", plain).as_subclass(torch.Tensor)
            plain = plain.cpu().contiguous()
            h.update(f"{name}|{plain.dtype}|{tuple(plain.shape)}|".encode())
            h.update(plain.view(torch.uint8).reshape(-1).numpy().data)
    return h.hexdigest()


# --------------------------------------------------------------------------- tensorscope


def tensorscope_status() -> tuple[bool, str]:
    """(whether ``ts.manage`` / ``ts.residency`` exist, a line saying which tensorscope)."""
    try:
        import tensorscope as ts
    except Exception as exc:  # pragma: no cover - depends on the environment
        return False, f"tensorscope not importable: {exc!r}"
    where = getattr(ts, "__file__", "?")
    version = getattr(ts, "__version__", "?")
    has = hasattr(ts, "manage") and hasattr(ts, "residency")
    return has, f"tensorscope {version} from {where}"


TENSORSCOPE_MISSING = (
    "skipped: this tensorscope has no ts.manage / ts.residency yet (docs/api.md §4 not "
    "implemented); the variant runs as soon as they exist"
)


def residency_summary(rep: Any) -> dict[str, Any]:
    """The numbers of ``ts.residency.report()`` the benchmarks print, read defensively."""
    out: dict[str, Any] = {}
    tiers = getattr(rep, "tiers", None)
    if tiers is not None:
        for tier_name in ("device", "host", "disk"):
            try:
                tier = tiers[tier_name]
            except (KeyError, IndexError, TypeError):
                continue
            for attr in ("resident_bytes", "peak_bytes"):
                value = getattr(tier, attr, None)
                if value is not None:
                    out[f"{tier_name}_{attr}"] = int(value)
    transfers = getattr(rep, "transfers", None)
    if transfers is not None:
        for attr in ("count", "bytes", "seconds"):
            value = getattr(transfers, attr, None)
            if value is None and isinstance(transfers, dict):
                value = transfers.get(attr)
            if value is not None:
                out[f"transfers_{attr}"] = value
    return out


# --------------------------------------------------------------------------- subprocesses


@dataclass
class WorkerRun:
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    wall_s: float = 0.0


def emit_result(result: dict[str, Any]) -> None:
    """Called in the worker: the one line the parent parses."""
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()


def worker_main(worker: Callable[[dict[str, Any]], dict[str, Any]], raw: str) -> int:
    """Body of a ``--worker`` subprocess: run ``worker`` on the JSON config, emit its result."""
    cfg = json.loads(raw)
    try:
        result = worker(cfg)
    except Exception as exc:
        traceback.print_exc()
        emit_result({"variant": cfg.get("variant"), "error": f"{type(exc).__name__}: {exc}"})
        return 1
    emit_result(result)
    return 0


def run_worker(script: str, config: dict[str, Any], timeout_s: float) -> WorkerRun:
    """Run ``python script --worker JSON`` in a fresh process; parse its result line."""
    cmd = [sys.executable, script, "--worker", json.dumps(config)]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return WorkerRun(False, error=f"timed out after {timeout_s:.0f} s", wall_s=timeout_s)
    wall = time.perf_counter() - start
    result: dict[str, Any] | None = None
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER) :])
    if result is not None and (result.get("error") or result.get("skipped")):
        return WorkerRun(False, result=result, error=str(result.get("error", "")), wall_s=wall)
    if done.returncode != 0 or result is None:
        tail = "\n".join(done.stdout.splitlines()[-5:])
        error = f"exit status {done.returncode} (traceback above, on stderr); stdout tail: {tail}"
        return WorkerRun(False, error=error, wall_s=wall)
    return WorkerRun(True, result=result, wall_s=wall)


def round_orders(variants: Sequence[str], rounds: int) -> list[list[str]]:
    """Variant order per round, rotated every round so no variant always runs first or last."""
    n = len(variants)
    return [[variants[(i + r) % n] for i in range(n)] for r in range(rounds)] if n else []


def parse_variants(text: str, known: Iterable[str]) -> list[str]:
    known = list(known)
    chosen = [v.strip().lower() for v in text.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in known]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {known}")
    return list(dict.fromkeys(chosen))


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.0f}"


def print_table(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]]) -> None:
    """Columns as (title, unit line); the first column left-aligned, the others right-aligned.

    A row of two cells (variant, message) prints the message across the columns.
    """
    full = [row for row in rows if len(row) == len(columns)]  # others: (name, message)
    widths = [
        max(len(title), len(unit), *(len(row[i]) for row in full)) + 2
        for i, (title, unit) in enumerate(columns)
    ]
    widths[0] -= 2

    def line(cells: Sequence[str]) -> str:
        first, rest = cells[0], cells[1:]
        return f"{first:<{widths[0]}}" + "".join(
            f"{c:>{w}}" for c, w in zip(rest, widths[1:], strict=False)
        )

    print(line([t for t, _ in columns]))
    print(line([u for _, u in columns]))
    for row in rows:
        print(line(row) if len(row) == len(columns) else f"{row[0]:<{widths[0]}}  {row[1]}")


# --------------------------------------------------------------------------- parent side


def add_common_args(parser: Any, variants: Sequence[str], rounds: int = 2) -> None:
    """The options both benchmarks share."""
    parser.add_argument("--variants", default=",".join(variants), help="comma-separated subset")
    parser.add_argument("--rounds", type=int, default=rounds, help="runs per variant, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=0,
        help="before each run wait up to this many seconds until other processes use less "
        "than a quarter of a core",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)


def skip_missing_tensorscope(
    variants: Sequence[str], tensorscope_variants: Sequence[str]
) -> tuple[list[str], dict[str, str], str]:
    """(variants to run, skipped variant -> why, a line saying which tensorscope is used)."""
    has_ts, ts_line = tensorscope_status()
    skipped: dict[str, str] = {}
    if not has_ts:
        skipped = {v: TENSORSCOPE_MISSING for v in variants if v in tensorscope_variants}
    return [v for v in variants if v not in skipped], skipped, ts_line


def run_rounds(
    script: str,
    active: Sequence[str],
    args: Any,
    make_cfg: Callable[[str, int], dict[str, Any]],
    unit: str,
    skipped: dict[str, str],
    errors: list[str],
) -> dict[str, list[dict[str, Any]]]:
    """Run every variant ``args.rounds`` times, rotating the order; results per variant.

    A worker result has at least ``times``, ``cpu_s``, ``others_s`` (per timed forward/step),
    ``peaks_above`` and ``setup_s``; the config and the run's wall time are added to it.
    """
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in active}
    for r, order in enumerate(round_orders(active, args.rounds)):
        for v in order:
            cfg = make_cfg(v, r)
            if args.quiet_wait > 0:
                wait_for_quiet(args.quiet_wait)
            run = run_worker(script, cfg, args.timeout)
            tag = f"  round {r + 1} {v:<10}"
            if run.result.get("skipped"):
                skipped[v] = run.result["skipped"]
                print(f"{tag} {skipped[v]}", file=sys.stderr)
                continue
            if not run.ok:
                errors.append(f"{v} (round {r + 1}): {run.error}")
                print(f"{tag} ERROR {run.error}", file=sys.stderr)
                continue
            res = run.result
            res.update(round=r, wall_s=run.wall_s, cfg=cfg)
            runs[v].append(res)
            timed = sum(res["times"]) or float("nan")
            print(
                f"{tag} {' '.join(f'{t:.2f}' for t in res['times'])} {unit}, "
                f"peak +{max(res['peaks_above']) / MiB:.0f} MiB, "
                f"cpu {sum(res['cpu_s']) / timed:.2f} cores, "
                f"others {sum(res['others_s']) / timed:.2f} cores, "
                f"setup {res['setup_s']:.1f} s, process {run.wall_s:.0f} s",
                file=sys.stderr,
            )
    return {v: rs for v, rs in runs.items() if rs}


def contention(rs: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(cores this process kept busy, cores other processes used) over the timed windows."""
    timed = sum(sum(res["times"]) for res in rs) or float("nan")
    cores = sum(sum(res["cpu_s"]) for res in rs) / timed
    others = sum(sum(res["others_s"]) for res in rs) / timed
    return cores, others


QUIET_OTHERS = 0.25  # a timed window is "quiet" when other processes used < 1/4 core during it


@dataclass
class TimeStats:
    """Times of the timed windows of all runs of a variant."""

    median: float  # over all windows
    quiet_median: float  # over the quiet windows only (nan if none)
    quiet_n: int
    n: int
    minimum: float

    @property
    def best_estimate(self) -> float:
        """The quiet median when there are quiet windows, else the median of all."""
        return self.quiet_median if self.quiet_n else self.median


def time_stats(rs: Sequence[dict[str, Any]]) -> TimeStats:
    samples = [(t, o) for res in rs for t, o in zip(res["times"], res["others_s"], strict=True)]
    times = [t for t, _ in samples]
    quiet = [t for t, o in samples if t > 0 and o / t < QUIET_OTHERS]
    return TimeStats(
        median(times),
        median(quiet),
        len(quiet),
        len(times),
        min(times) if times else float("nan"),
    )


def ratio_to(stats: TimeStats, ref: TimeStats | None) -> tuple[float, str]:
    """(time ratio to ref, how it was computed): quiet medians when both have quiet windows."""
    if ref is None:
        return float("nan"), "n/a"
    if stats.quiet_n and ref.quiet_n:
        return stats.quiet_median / ref.quiet_median, "quiet"
    return stats.median / ref.median, "all"


CONTENTION_NOTE = (
    "cores = this process's CPU seconds / wall seconds over the timed windows (2.00 = both "
    "threads busy); others = cores the other processes used meanwhile (the machine is shared: "
    "high = timings noisy, rerun with --quiet-wait 120); quiet = median over the windows where "
    f"others < {QUIET_OTHERS} cores (how many of all in parentheses); min = fastest window; "
    "x plain = ratio of quiet medians when both sides have quiet windows (marked q), else of "
    "all medians"
)


def residency_line(summary: dict[str, Any], budget: float) -> str:
    seconds = summary.get("transfers_seconds")
    return (
        f"device peak {fmt_mib(summary.get('device_peak_bytes'))} MiB "
        f"(budget {budget / MiB:.0f}), {summary.get('transfers_count', '-')} moves, "
        f"{fmt_mib(summary.get('transfers_bytes'))} MiB"
        + ("" if seconds is None else f" in {seconds:.2f} s")
        + " (last round)"
    )
