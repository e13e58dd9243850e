"""A model bigger than RAM: tensorscope (Flow, Genoa) vs accelerate, streaming from safetensors.

Model: a Llama-shaped ``LlamaForCausalLM`` (hidden 4096, intermediate 11008, 32 layers, 32 heads,
vocab 32000, untied ``lm_head``: 6.74 B parameters, 25.1 GiB in fp32), random weights, written
once as ~2 GiB safetensors shards in the layout ``save_pretrained`` writes (shards,
``model.safetensors.index.json``, ``config.json``): larger than this machine's RAM. Nothing is
downloaded. ``--quick``: hidden 2048, intermediate 5504, 4 layers (0.33 B parameters, 1.24 GiB,
256 MiB shards, budget 256 MiB), end to end in about two minutes. ``--layers N`` changes the
depth (e.g. a mid-size model of a few GiB with the full width).

Creating the checkpoint never holds the model in RAM: the model is built under
``ts.empty_init()`` (meta tensors) to learn the state-dict keys, shapes and dtypes; then shard by
shard the tensors are made (``normal(0, initializer_range)`` for matrices, ones for the norms,
each from its own generator seeded by the seed and the key, so a tensor does not depend on the
sharding), written with ``safetensors.torch.save_file``, flushed (``fsync``), dropped from the
page cache and freed: one shard in RAM at a time. A marker file written last
(``bigger_than_ram.json``: the spec and every file's size) says the checkpoint is complete; a
complete checkpoint of the same spec is reused. Before writing anything a tiny model goes through
the same writer and must load with ``AutoModelForCausalLM.from_pretrained`` (no missing,
unexpected or mismatched keys, equal tensors), and the disk space needed is printed and checked
(``shutil.disk_usage``): the checkpoint, plus accelerate's copy of the offloaded weights unless
``--skip-accelerate``.

Variants, each in a fresh subprocess (``--worker``), ``--rounds`` times in a rotated order:

* ``io``: every shard file read from a cold page cache, ``--io-repeats`` times by each of three
  methods (one stream of 64 MiB ``read()``s; two such streams; ``mmap`` +
  ``MADV_POPULATE_READ``): the fastest is the time a forward that streams all weights from the
  disk can approach (the I/O bound). On a virtual disk one stream of ``read()``s can be 2x slower
  than the others, so the bound is not one stream's time.
* ``ram`` (compute): ``from_pretrained`` (transformers 5 maps the safetensors files: the weights
  are page-cache pages mapped in, RSS but not anonymous memory), weights warm, not evicted: the
  forward time without any I/O. Only when the weights fit in RAM comfortably (< half of
  ``MemAvailable``): for the full-size model it cannot be measured, and the ratio to
  ``max(compute, I/O)`` uses the I/O bound alone (said in the output).
* ``flow`` / ``genoa`` (``--policies``): ``ts.empty_init()`` + ``from_config``,
  ``ts.residency.configure(device="cpu", policy=..., budget=...)``, ``ts.manage(model,
  checkpoint=dir)`` (the load time); the checkpoint files are the disk tier, mapped, nothing is
  copied. ``handle.remove()`` is not called: it would bring the whole model into RAM.
* ``accelerate``: ``init_empty_weights()`` + ``from_config``, ``load_checkpoint_and_dispatch``
  with ``infer_auto_device_map(max_memory={"cpu": budget})`` (the rest on ``"disk"``) and an
  ``offload_folder`` next to the checkpoint: accelerate reads every shard into RAM and writes the
  weights mapped to ``"disk"`` into the folder as numpy files (a second copy on disk). A map with
  everything on ``"disk"`` (``{"": "disk"}``) fails in accelerate 1.x
  (``SafetensorError: device disk is invalid``: it hands "disk" to ``safetensors.load_file``);
  when the inferred map is all disk, the norm and rotary modules go on "cpu" and that is said.
  If accelerate cannot run the model (an error, memory, disk, the time limit), the row says how
  it failed: the exit status, the error, the phase, the peak RSS the parent saw.

Per model variant, with the page cache cold: the checkpoint files (and accelerate's offload
folder) are evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before every measured forward
and before every forward step inside ``generate()`` (a forward pre-hook). This models a model
larger than RAM: every forward reads from the disk what the process does not hold itself (pages
it keeps mapped stay: tensorscope's budget, accelerate's CPU part). Measured: the load time;
the first forward and the median of ``--forwards`` steady forwards of a 1x32 prompt
(``torch.no_grad()``, ``use_cache=False``); ``generate()`` of 16 new tokens (greedy, KV cache,
``min_new_tokens=16`` so an EOS does not stop it early) in tokens/s; peak RSS and peak anonymous
memory (``RssAnon`` in ``/proc/self/status``, sampled every 5 ms on a thread: file pages of the
page cache are the kernel's, mapped ones still count in RSS) over the load, the forwards and
``generate()``, above the RSS before the model was built. The logits of the first forward are
compared with the reference (``ram`` when it ran, else accelerate) and the generated tokens too.
A parent thread also samples each worker's memory: a worker whose anonymous memory passes
``--mem-limit`` is killed (so a variant that loads everything into RAM fails here, not through
the kernel's OOM killer on a shared machine), and its peak is reported when it dies.

Failures of accelerate are results (a row saying how it failed); the exit status is non-zero
when another variant fails.

Run:
    python benchmarks/bigger_than_ram.py --quick          # 1.24 GiB checkpoint, ~2 min
    python benchmarks/bigger_than_ram.py --dry-run        # the plan and the disk check only
    python benchmarks/bigger_than_ram.py                  # 25 GiB checkpoint + accelerate's
                                                          # 25 GiB copy: ~52 GiB disk, ~40 min
    python benchmarks/bigger_than_ram.py --skip-accelerate --policies flow --json out.json
    python benchmarks/bigger_than_ram.py --clean          # remove the checkpoint at the end
    python benchmarks/bigger_than_ram.py --quiet-wait 120 # wait for a quiet machine per worker
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import itertools
import json
import mmap
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _offload_common as common  # sets HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE on import
from offload_inference import _evict_page_cache as evict_page_cache

MiB, GiB = common.MiB, common.GiB

FULL_CONFIG = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
QUICK_CONFIG = {
    **FULL_CONFIG,
    "hidden_size": 2048,
    "intermediate_size": 5504,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
}
TINY_CONFIG = {  # the layout self-check
    **FULL_CONFIG,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 128,
}
MODEL_SEED = 0
INPUT_SEED = 1234
PROMPT_LEN = 32
NEW_TOKENS = 16
MARKER = "bigger_than_ram.json"  # written last: the checkpoint is complete
INDEX = "model.safetensors.index.json"
DISK_MARGIN = 1 * GiB
POLICIES = ("flow", "genoa")
LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


# --------------------------------------------------------------------------- the checkpoint


@dataclass(frozen=True)
class Entry:
    """One stored tensor: its state-dict key, shape and dtype name."""

    key: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"
    nbytes: int


@dataclass
class Plan:
    config: dict[str, Any]
    entries: list[Entry]
    shards: list[list[Entry]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def params(self) -> int:
        return sum(e.nbytes // 4 for e in self.entries)

    def shard_name(self, i: int) -> str:
        return f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"

    def spec(self, seed: int) -> dict[str, Any]:
        return {
            "config": self.config,
            "seed": seed,
            "init": "normal(0, initializer_range) matrices, ones for norms; per-key generators",
            "shards": [[e.key for e in shard] for shard in self.shards],
        }


def llama_config(overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**overrides)


def plan_checkpoint(config_dict: dict[str, Any], shard_bytes: int) -> Plan:
    """Keys, shapes and dtypes of the model's state dict (built on meta), grouped into shards
    of at most ``shard_bytes`` in state-dict order (as ``save_pretrained`` does)."""
    import torch
    from transformers import AutoModelForCausalLM

    import tensorscope as ts

    with ts.empty_init(include_buffers=True):
        model = AutoModelForCausalLM.from_config(llama_config(config_dict))
    entries: list[Entry] = []
    seen: set[int] = set()
    for key, t in model.state_dict().items():  # persistent entries only, as save_pretrained
        if id(t) in seen:
            raise SystemExit(f"tied tensor {key}: this writer handles untied models only")
        seen.add(id(t))
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append(Entry(key, tuple(t.shape), dtype, t.numel() * t.element_size()))
    del model, torch
    plan = Plan(config_dict, entries)
    current: list[Entry] = []
    size = 0
    for e in entries:
        if current and size + e.nbytes > shard_bytes:
            plan.shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        plan.shards.append(current)
    return plan


def make_tensor(entry: Entry, seed: int, std: float) -> Any:
    """The tensor of ``entry``: ones for norm weights, zeros for other vectors, else
    normal(0, std); from a generator seeded by (seed, key)."""
    import torch

    dtype = getattr(torch, entry.dtype)
    if len(entry.shape) == 1:
        return (torch.ones if "norm" in entry.key else torch.zeros)(entry.shape, dtype=dtype)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(entry.key.encode()))
    return torch.empty(entry.shape, dtype=dtype).normal_(0.0, std, generator=gen)


def checkpoint_complete(directory: Path, plan: Plan, seed: int) -> bool:
    """The marker is there, says this spec, and every file has the size it recorded."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("spec") != json.loads(json.dumps(plan.spec(seed))):
        return False
    files = marker.get("files", {})
    return bool(files) and all(
        (directory / name).is_file() and (directory / name).stat().st_size == size
        for name, size in files.items()
    )


def _our_files(directory: Path) -> list[Path]:
    """Files this script writes into a checkpoint directory (and nothing else)."""
    if not directory.is_dir():
        return []
    names = {MARKER, INDEX, "config.json", "generation_config.json"}
    return [
        p
        for p in directory.iterdir()
        if p.name in names or (p.name.startswith("model-") and ".safetensors" in p.name)
    ]


def remove_checkpoint(directory: Path) -> None:
    for p in _our_files(directory):
        p.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty (other files there) or already gone
        directory.rmdir()


def write_checkpoint(directory: Path, plan: Plan, seed: int, progress: bool = True) -> None:
    """Write the shards one at a time (one shard in RAM), then the index, the config and the
    marker (last)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).unlink(missing_ok=True)
    for stale in _our_files(directory):
        stale.unlink()
    config = llama_config(plan.config)
    std = float(config.initializer_range)
    weight_map: dict[str, str] = {}
    files: dict[str, int] = {}
    bar = tqdm(
        total=plan.total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="writing the checkpoint",
        disable=not (progress and sys.stderr.isatty()),  # a log gets one line, below
        file=sys.stderr,
    )
    start = time.perf_counter()
    with bar:
        for i, shard in enumerate(plan.shards):
            name = plan.shard_name(i)
            bar.set_postfix_str(f"shard {i + 1}/{len(plan.shards)}")
            tensors: dict[str, Any] = {}
            for e in shard:
                tensors[e.key] = make_tensor(e, seed, std)
                bar.update(e.nbytes)
            tmp = directory / (name + ".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            del tensors
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)  # clean pages: the eviction before each forward can drop them
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            tmp.rename(directory / name)
            files[name] = (directory / name).stat().st_size
            weight_map.update((e.key, name) for e in shard)
    index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(str(directory))
    for name in (INDEX, "config.json"):
        files[name] = (directory / name).stat().st_size
    marker = {"spec": plan.spec(seed), "files": files}
    (directory / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    if progress and not sys.stderr.isatty():
        print(
            f"wrote the checkpoint: {len(plan.shards)} shards, {plan.total_bytes / 2**30:.2f} GiB, "
            f"{time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def self_check_layout(seed: int) -> str:
    """Write a tiny model with ``write_checkpoint`` and load it with ``from_pretrained``: no
    missing/unexpected/mismatched keys, every tensor equal to what the writer made."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    plan = plan_checkpoint(TINY_CONFIG, shard_bytes=64 * 1024)
    directory = Path(tempfile.mkdtemp(prefix="bigger-than-ram-layout-"))
    verbosity = hf_logging.get_verbosity()
    try:
        write_checkpoint(directory, plan, seed, progress=False)
        hf_logging.set_verbosity_error()
        model, info = AutoModelForCausalLM.from_pretrained(
            str(directory), output_loading_info=True, dtype=torch.float32
        )
        problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
        problems.update({"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
        if problems:
            raise SystemExit(f"layout self-check: from_pretrained reports {problems}")
        std = float(model.config.initializer_range)
        state = model.state_dict()
        for e in plan.entries:
            if not torch.equal(state[e.key], make_tensor(e, seed, std)):
                raise SystemExit(f"layout self-check: {e.key} differs after from_pretrained")
        if set(state) != {e.key for e in plan.entries}:
            raise SystemExit("layout self-check: the state dict has other keys than written")
    finally:
        hf_logging.set_verbosity(verbosity)
        remove_checkpoint(directory)
        shutil.rmtree(directory, ignore_errors=True)
    return (
        f"layout self-check: a {len(plan.shards)}-shard tiny Llama written by this script loads "
        "with AutoModelForCausalLM.from_pretrained (no missing/unexpected/mismatched keys, "
        "equal tensors)"
    )


# --------------------------------------------------------------------------- memory and cache


def mem_info() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value, *_ = line.split()
            out[key.rstrip(":")] = int(value) * 1024
    return out


def proc_memory(pid: int | str = "self") -> tuple[int, int]:
    """(VmRSS, RssAnon) of a process in bytes, from /proc/PID/status; (0, 0) if it is gone."""
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, anon


class StatusSampler(common.PeakSampler):
    """``PeakSampler`` whose anonymous memory is ``RssAnon`` of /proc/self/status (exact)
    rather than RSS - shared."""

    def sample(self) -> None:
        rss, anon = proc_memory()
        self.samples += 1
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_anon = max(self.peak_anon, anon)


def cached_fraction(paths: Sequence[str | Path]) -> float:
    """Fraction of the files' pages in the page cache (``mincore`` of a fresh mapping)."""
    page = mmap.PAGESIZE
    total = resident = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            ok = LIBC.mincore(addr, size, vec) == 0
            LIBC.munmap(addr, size)
        finally:
            os.close(fd)
        if ok:
            total += pages
            resident += pages - bytes(vec).count(0)
    return resident / total if total else float("nan")


def shard_paths(directory: str | Path) -> list[Path]:
    index = json.loads((Path(directory) / INDEX).read_text())
    return [Path(directory) / n for n in sorted(set(index["weight_map"].values()))]


# --------------------------------------------------------------------------- worker


class Status:
    """The worker's current phase, in a file the parent reads when the worker dies."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start = time.perf_counter()

    def __call__(self, phase: str) -> None:
        print(f"  [worker {os.getpid()}] {phase}", file=sys.stderr, flush=True)
        rss, anon = proc_memory()
        data = {"phase": phase, "t": time.perf_counter() - self.start, "rss": rss, "anon": anon}
        Path(self.path).write_text(json.dumps(data))


def _read_file(path: Path, view: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        n = 0
        while k := os.readv(fd, [view]):
            n += k
        return n
    finally:
        os.close(fd)


def _read_sequential(paths: Sequence[Path]) -> int:
    """One stream of read()s (64 MiB) through every file, one after the other."""
    view = memoryview(bytearray(64 * MiB))
    return sum(_read_file(p, view) for p in paths)


def _read_two_streams(paths: Sequence[Path]) -> int:
    """Two threads, each reading whole files (the next one not taken yet) with read()."""
    pending = list(reversed(paths))
    lock = threading.Lock()
    done = [0, 0]

    def stream(i: int) -> None:
        view = memoryview(bytearray(64 * MiB))
        while True:
            with lock:
                if not pending:
                    return
                path = pending.pop()
            done[i] += _read_file(path, view)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done)


def _populate_mappings(paths: Sequence[Path]) -> int:
    """Map each file and fault it in with ``MADV_POPULATE_READ`` (how a mapped tier reads)."""
    advice = getattr(mmap, "MADV_POPULATE_READ", 22)
    n = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapping:
                mapping.madvise(advice)
            n += size
        finally:
            os.close(fd)
    return n


IO_METHODS: dict[str, Callable[[Sequence[Path]], int]] = {
    "read() 1 stream": _read_sequential,
    "read() 2 streams": _read_two_streams,
    "mmap + MADV_POPULATE_READ": _populate_mappings,
}


def io_worker(cfg: dict[str, Any], status: Status) -> dict[str, Any]:
    """Every shard read from a cold page cache, by each method, ``io_repeats`` times."""
    paths = shard_paths(cfg["dir"])
    reads: dict[str, list[float]] = {name: [] for name in IO_METHODS}
    cpu: list[float] = []
    others: list[float] = []
    cached: list[float] = []
    nbytes = 0
    for r in range(cfg["io_repeats"]):
        for name, read in IO_METHODS.items():
            status(f"reading every shard: {name} ({r + 1}/{cfg['io_repeats']})")
            evict_page_cache(cfg["dir"])
            cached.append(cached_fraction(paths))
            with common.Window() as w:
                nbytes = read(paths)
            reads[name].append(w.wall)
            cpu.append(w.cpu)
            others.append(w.others)
    evict_page_cache(cfg["dir"])
    best = min(reads, key=lambda name: min(reads[name]))
    read_s = min(reads[best])
    return {
        "variant": "io",
        "bytes": nbytes,
        "reads": reads,
        "best_method": best,
        "read_s": read_s,
        "gb_per_s": nbytes / read_s / 1e9,
        "times": [t for ts_ in reads.values() for t in ts_],
        "cpu_s": cpu,
        "others_s": others,
        "cached_before": max(cached),
    }


def _accelerate_map(model: Any, budget: int) -> tuple[dict[str, str], str]:
    """accelerate's own map for ``max_memory={"cpu": budget}``; made loadable when all disk."""
    from accelerate import infer_auto_device_map

    device_map = dict(
        infer_auto_device_map(
            model, max_memory={"cpu": budget}, no_split_module_classes=model._no_split_modules
        )
    )
    if set(device_map.values()) != {"disk"}:
        return device_map, ""
    # {"": "disk"} (everything on disk) makes accelerate call safetensors.load_file(device="disk")
    # -> "SafetensorError: device disk is invalid". Put the tiny modules on the CPU instead.
    inner = model.model
    device_map = {"model.embed_tokens": "disk"}
    device_map.update({f"model.layers.{i}": "disk" for i in range(len(inner.layers))})
    device_map.update({"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"})
    note = (
        f"accelerate's infer_auto_device_map(max_memory={{'cpu': {budget}}}) puts everything on "
        "'disk' ({'': 'disk'}), which accelerate cannot load (SafetensorError: device disk is "
        "invalid); model.norm and model.rotary_emb were put on 'cpu' to make it load"
    )
    return device_map, note


def model_worker(cfg: dict[str, Any], status: Status) -> dict[str, Any]:
    import torch

    torch.set_num_threads(cfg["threads"])
    from transformers import AutoConfig, AutoModelForCausalLM

    import tensorscope as ts

    variant = cfg["variant"]
    directory = cfg["dir"]
    if variant == "accelerate":
        import accelerate.utils.modeling as accelerate_modeling
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch

        # Its per-shard progress bars (on stderr) ignore TQDM_DISABLE; nothing else changes.
        accelerate_modeling.is_tqdm_available = lambda: False
    config = AutoConfig.from_pretrained(directory)
    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, config.vocab_size, (1, PROMPT_LEN), generator=gen)
    cold_dirs = [directory] if variant != "ram" else []
    out: dict[str, Any] = {"variant": variant, "notes": []}

    def evict() -> None:
        for d in cold_dirs:
            evict_page_cache(d)

    common.warm_up_runtime()
    common.settle_memory()
    base_rss, base_anon = proc_memory()
    out.update(baseline_rss=base_rss, baseline_anon=base_anon)
    samplers: dict[str, StatusSampler] = {}

    def sampler(phase: str) -> StatusSampler:
        samplers[phase] = StatusSampler(interval_s=0.005)
        return samplers[phase]

    # ---- load
    status("load")
    handle: Any = None
    with sampler("load"), common.Window() as load_w:
        if variant == "ram":
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        elif variant == "accelerate":
            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(config).eval()
            device_map, note = _accelerate_map(model, cfg["budget"])
            if note:
                out["notes"].append(note)
            out["device_map"] = device_map
            offload = cfg["offload_dir"]
            cold_dirs.append(offload)
            model = load_checkpoint_and_dispatch(
                model,
                directory,
                device_map=device_map,
                offload_folder=offload,
                no_split_module_classes=model._no_split_modules,
            )
        else:
            with ts.empty_init():
                model = AutoModelForCausalLM.from_config(config).eval()
            limit = cfg.get("prefetch_limit")
            policy: Any = ts.Flow(prefetch_limit=limit) if variant == "flow" else variant
            ts.residency.configure(device="cpu", policy=policy, budget=cfg["budget"])
            handle = ts.manage(model, checkpoint=directory)
    out["load_s"] = load_w.wall
    common.settle_memory()
    out["after_load_rss"], out["after_load_anon"] = proc_memory()
    if handle is not None:
        rep = ts.residency.report(reset=True)
        print(f"--- ts.residency.report() [{variant}] after manage ---\n{rep}", file=sys.stderr)
        out["residency_load"] = _ts_summary(rep)

    # ---- forwards
    times: list[float] = []
    cpu: list[float] = []
    others: list[float] = []
    cached: list[float] = []
    # The files a cold forward reads: the shards, and accelerate's offload files.
    paths = shard_paths(directory) + [
        Path(root) / f for d in cold_dirs[1:] for root, _, files in os.walk(d) for f in files
    ]
    with torch.no_grad():
        for i in range(1 + cfg["forwards"]):
            status(f"forward {i + 1}/{1 + cfg['forwards']}")
            evict()
            cached.append(cached_fraction(paths))
            with sampler(f"forward{i}"), common.Window() as w:
                logits = model(input_ids=input_ids, use_cache=False).logits
            times.append(w.wall)
            cpu.append(w.cpu)
            others.append(w.others)
            if i == 0:
                torch.save(logits.detach().clone(), cfg["logits_path"])
            del logits
    out.update(
        times=times,
        first_s=times[0],
        steady=times[1:],
        steady_s=common.median(times[1:]),
        cpu_s=cpu,
        others_s=others,
        cached_before_forward=cached,
    )

    # ---- generate (cold before every forward step)
    status(f"generate {NEW_TOKENS} tokens")
    steps: list[float] = []

    def pre_hook(module: Any, args: Any) -> None:
        evict()
        steps.append(time.perf_counter())

    hook = model.register_forward_pre_hook(pre_hook)
    eos = config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    try:
        with torch.no_grad(), sampler("generate"), common.Window() as gen_w:
            ids = model.generate(
                input_ids,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                use_cache=True,
                pad_token_id=pad,
            )
    finally:
        hook.remove()
    new = ids[0, PROMPT_LEN:].tolist()
    steps.append(time.perf_counter())
    step_s = [b - a for a, b in itertools.pairwise(steps)]
    out.update(
        generate_s=gen_w.wall,
        new_tokens=len(new),
        tokens=new,
        tokens_per_s=len(new) / gen_w.wall,
        decode_step_s=common.median(step_s[1:]),  # per token after the prefill
        generate_cpu_s=gen_w.cpu,
        generate_others_s=gen_w.others,
    )
    if handle is not None:
        rep = ts.residency.report()
        print(f"--- ts.residency.report() [{variant}] forwards ---\n{rep}", file=sys.stderr)
        out["residency"] = _ts_summary(rep)
    out["phases"] = {
        name: {"peak_rss": s.peak_rss, "peak_anon": s.peak_anon, "samples": s.samples}
        for name, s in samplers.items()
    }
    out["peak_rss"] = max(s.peak_rss for s in samplers.values())
    out["peak_anon"] = max(s.peak_anon for s in samplers.values())
    out["run_peak_rss"] = max(s.peak_rss for n, s in samplers.items() if n != "load")
    out["run_peak_anon"] = max(s.peak_anon for n, s in samplers.items() if n != "load")
    status("done")
    return out


def _ts_summary(rep: Any) -> dict[str, Any]:
    summary = common.residency_summary(rep)
    for attr in ("budget_bytes", "peak_bytes", "checkpoint_bytes", "checkpoint_placements"):
        summary[attr] = getattr(rep, attr, None)
    summary["converted"] = getattr(rep, "converted", None)
    summary["prefetches"] = getattr(rep, "prefetches", None)
    return summary


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    status = Status(cfg["status_path"])
    if cfg["variant"] == "io":
        return io_worker(cfg, status)
    return model_worker(cfg, status)


# --------------------------------------------------------------------------- parent


class ChildWatcher:
    """Sample the memory of this process's children every ``interval_s`` on a thread; kill a
    child whose anonymous memory passes ``limit`` (before the kernel's OOM killer picks some
    process of a shared machine)."""

    def __init__(self, limit: int, interval_s: float = 0.05) -> None:
        import psutil

        self.limit = limit
        self.interval_s = interval_s
        self.peak_rss = self.peak_anon = 0
        self.killed = ""
        self._me = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bigger-than-ram-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for child in self._me.children(recursive=True):
                rss, anon = proc_memory(child.pid)
                self.peak_rss = max(self.peak_rss, rss)
                self.peak_anon = max(self.peak_anon, anon)
                if anon > self.limit and not self.killed:
                    self.killed = (
                        f"killed by this benchmark: anonymous memory {anon / MiB:.0f} MiB > "
                        f"--mem-limit {self.limit / MiB:.0f} MiB"
                    )
                    with contextlib.suppress(OSError):
                        os.kill(child.pid, signal.SIGKILL)

    def __enter__(self) -> ChildWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_variant(cfg: dict[str, Any], timeout: float, mem_limit: int) -> dict[str, Any]:
    """One worker; on failure a result that says how it failed (status, error, phase, peak)."""
    Path(cfg["status_path"]).unlink(missing_ok=True)
    with ChildWatcher(mem_limit) as watch:
        run = common.run_worker(__file__, cfg, timeout)
    res = dict(run.result)
    res.setdefault("variant", cfg["variant"])
    res.update(process_s=run.wall_s, watched_peak_rss=watch.peak_rss)
    res["watched_peak_anon"] = watch.peak_anon
    if run.ok:
        return res
    try:
        phase = json.loads(Path(cfg["status_path"]).read_text())
    except (OSError, ValueError):
        phase = {}
    error = watch.killed or run.error
    if "exit status -9" in error and not watch.killed:
        error += " (SIGKILL: the kernel's OOM killer?)"
    res.update(
        error=error,
        failed_phase=phase.get("phase", "start-up"),
        failed_after_s=phase.get("t"),
    )
    return res


def failure_text(res: dict[str, Any]) -> str:
    after = res.get("failed_after_s")
    when = f" {after:.0f} s into the worker" if after is not None else ""
    return (
        f"FAILED in phase '{res['failed_phase']}'{when}: {res['error']}; peak RSS "
        f"{res['watched_peak_rss'] / GiB:.2f} GiB, anon {res['watched_peak_anon'] / GiB:.2f} GiB "
        f"(process {res['process_s']:.0f} s)"
    )


def check_disk(directory: Path, need: int, what: str) -> None:
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    print(
        f"disk: {what} = {need / GiB:.1f} GiB needed (with {DISK_MARGIN / GiB:.0f} GiB margin); "
        f"{free / GiB:.1f} GiB free on the filesystem of {probe}"
    )
    if need > free:
        raise SystemExit(
            f"not enough disk space: {need / GiB:.1f} GiB needed, {free / GiB:.1f} GiB free under "
            f"{probe}. Free some space, pass --dir on a larger filesystem, or --skip-accelerate "
            "(no copy of the offloaded weights)."
        )


def _variant_label(v: str) -> str:
    return {
        "io": "I/O bound (cold read)",
        "ram": "in RAM (compute)",
        "flow": "tensorscope flow",
        "genoa": "tensorscope genoa",
        "accelerate": "accelerate",
    }[v]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1.24 GiB model, budget 256 MiB")
    parser.add_argument("--dir", help="checkpoint directory (default: under $TMPDIR or /tmp)")
    parser.add_argument("--clean", action="store_true", help="remove the checkpoint at the end")
    parser.add_argument("--budget", help="tensorscope budget / accelerate CPU memory, e.g. 2GiB")
    parser.add_argument("--layers", type=int, help="decoder layers (default 32; quick 4)")
    parser.add_argument("--shard-size", help="bytes per shard (default 2GiB; quick 256MiB)")
    parser.add_argument("--policies", default="flow,genoa", help="tensorscope policies to run")
    parser.add_argument("--skip-accelerate", action="store_true", help="no accelerate variant")
    parser.add_argument(
        "--prefetch-limit",
        type=int,
        default=None,
        help="Flow(prefetch_limit=N): a fixed read-ahead of N placements (default: the "
        "measured pace decides)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs per variant, interleaved")
    parser.add_argument("--forwards", type=int, default=None, help="steady forwards (3; quick 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each worker")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per worker")
    parser.add_argument(
        "--io-repeats", type=int, default=2, help="cold reads of all shards per I/O method"
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=0,
        help="before each worker wait up to this many seconds until other processes use less "
        "than a quarter of a core (the machine is shared: timings depend on it)",
    )
    parser.add_argument(
        "--mem-limit",
        help="kill a worker whose anonymous memory passes this (default: MemAvailable - 1 GiB)",
    )
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan and the disk check, write nothing"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return common.worker_main(worker, args.worker)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    from tensorscope._units import parse_bytes

    quick = args.quick
    config_dict = dict(QUICK_CONFIG if quick else FULL_CONFIG)
    if args.layers is not None:
        config_dict["num_hidden_layers"] = args.layers
    budget = parse_bytes(args.budget or ("256MiB" if quick else "2GiB"), what="--budget")
    shard_bytes = parse_bytes(args.shard_size or ("256MiB" if quick else "2GiB"), what="shard")
    forwards = args.forwards if args.forwards is not None else (2 if quick else 3)
    policies = common.parse_variants(args.policies, POLICIES)
    tmp_root = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())
    name = "quick" if quick else "full"
    if args.layers is not None:
        name += f"-{args.layers}-layers"
    directory = Path(args.dir or tmp_root / f"tensorscope-bigger-than-ram-{name}").resolve()
    offload_dir = Path(str(directory) + "-accelerate-offload")
    wall_start = time.perf_counter()

    # ---- what, and whether it fits
    plan = plan_checkpoint(config_dict, shard_bytes)
    total = plan.total_bytes
    mem = mem_info()
    ram, available = mem["MemTotal"], mem["MemAvailable"]
    mem_limit = (
        parse_bytes(args.mem_limit, what="--mem-limit") if args.mem_limit else available - GiB
    )
    print(
        f"bigger than RAM: LlamaForCausalLM {config_dict}, {plan.params / 1e9:.2f} B params, "
        f"fp32 random weights (seed {MODEL_SEED}) = {total / GiB:.2f} GiB in "
        f"{len(plan.shards)} shards of <= {shard_bytes / GiB:.2f} GiB; RAM {ram / GiB:.1f} GiB "
        f"({available / GiB:.1f} GiB available): the checkpoint "
        + ("is LARGER than RAM" if total > ram else "fits in RAM")
    )
    print(
        f"prompt 1x{PROMPT_LEN} tokens (seed {INPUT_SEED}), no_grad; 1 first + {forwards} steady "
        f"forwards (use_cache=False); generate() {NEW_TOKENS} new tokens greedy with KV cache; "
        f"budget {budget / MiB:.0f} MiB (tensorscope) / CPU max_memory (accelerate); "
        f"{args.threads} threads; {args.rounds} round(s)"
    )
    print(
        "COLD: the checkpoint files (and accelerate's offload folder) are evicted from the page "
        "cache (posix_fadvise DONTNEED) before every measured forward and every generate() step: "
        "this models a model larger than RAM, where every forward reads its weights from the "
        "disk (pages a process keeps mapped stay: tensorscope's budget)"
    )
    complete = checkpoint_complete(directory, plan, MODEL_SEED)
    acc_need = 0 if args.skip_accelerate else total
    need = (0 if complete else total) + acc_need + DISK_MARGIN
    parts = ([] if complete else [f"checkpoint {total / GiB:.1f} GiB"]) + (
        [] if args.skip_accelerate else [f"accelerate's offload copy ~{acc_need / GiB:.1f} GiB"]
    )
    check_disk(directory, need, " + ".join(parts) if parts else "nothing new")
    if args.dry_run:
        sizes = sorted({sum(e.nbytes for e in shard) for shard in plan.shards})
        print(
            f"dry run: {len(plan.entries)} tensors in {len(plan.shards)} shards of "
            f"{sizes[0] / GiB:.2f}-{sizes[-1] / GiB:.2f} GiB into {directory} "
            f"({'complete, reused' if complete else 'to be written'}); nothing written"
        )
        return 0

    # ---- the checkpoint
    if complete:
        print(f"checkpoint: reusing the complete one in {directory}")
    else:
        if directory.is_dir() and any(directory.iterdir()) and not (directory / MARKER).exists():
            raise SystemExit(
                f"{directory} is not empty and was not written by this script (no {MARKER}): "
                "refusing to write shards there; pass an empty or new --dir"
            )
        print(self_check_layout(MODEL_SEED))
        print(f"checkpoint: writing {total / GiB:.2f} GiB to {directory} (one shard in RAM)")
        start = time.perf_counter()
        write_checkpoint(directory, plan, MODEL_SEED)
        print(f"checkpoint: written in {time.perf_counter() - start:.0f} s")
    os.environ["TQDM_DISABLE"] = "1"  # the workers' progress bars (accelerate's) stay quiet

    # ---- the variants
    variants = ["io"]
    fits = total < available / 2
    if fits:
        variants.append("ram")
    variants += policies
    if not args.skip_accelerate:
        variants.append("accelerate")
    notes: list[str] = []
    if not fits:
        notes.append(
            f"compute (forward with the weights warm in RAM) cannot be measured: the weights "
            f"({total / GiB:.1f} GiB) do not fit in RAM ({available / GiB:.1f} GiB available); "
            "'x bound' uses the I/O bound alone"
        )
    tmp = Path(tempfile.mkdtemp(prefix="bigger-than-ram-run-"))
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for r, order in enumerate(common.round_orders(variants, args.rounds)):
            for v in order:
                cfg = {
                    "variant": v,
                    "dir": str(directory),
                    "budget": budget,
                    "forwards": forwards,
                    "threads": args.threads,
                    "prefetch_limit": args.prefetch_limit,
                    "io_repeats": args.io_repeats,
                    "offload_dir": str(offload_dir),
                    "logits_path": str(tmp / f"{v}-{r}.pt"),
                    "status_path": str(tmp / f"{v}-{r}.status"),
                }
                if args.quiet_wait > 0:
                    common.wait_for_quiet(args.quiet_wait)
                print(f"round {r + 1}: {v} ...", file=sys.stderr, flush=True)
                try:
                    res = run_variant(cfg, args.timeout, mem_limit)
                finally:
                    shutil.rmtree(offload_dir, ignore_errors=True)
                res.update(round=r, cfg=cfg)
                results[v].append(res)
                print(f"round {r + 1}: {v}: {_one_line(res)}", file=sys.stderr, flush=True)
        report = _report(results, plan, budget, notes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(offload_dir, ignore_errors=True)
    raw = {
        "model": config_dict,
        "params": plan.params,
        "total_bytes": total,
        "shards": len(plan.shards),
        "budget_bytes": budget,
        "ram_bytes": ram,
        "available_bytes": available,
        "threads": args.threads,
        "forwards": forwards,
        "new_tokens": NEW_TOKENS,
        "prompt_len": PROMPT_LEN,
        "dir": str(directory),
        "notes": notes,
        "summary": report,
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1, default=str) + "\n")
        print(f"raw results: {args.json}")
    if args.clean:
        remove_checkpoint(directory)
        print(f"removed the checkpoint {directory}")
    print(f"total wall time {time.perf_counter() - wall_start:.0f} s")
    failed = [v for v, rs in results.items() for res in rs if res.get("error")]
    return 1 if failed and set(failed) != {"accelerate"} else 0


def print_markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A markdown table, padded to read as text too. A row of two cells (variant, message)
    has the message in the second column and the others empty."""
    cells = [[*row, *[""] * (len(columns) - len(row))] for row in rows]
    full = [row for row in rows if len(row) == len(columns)]
    widths = [max([len(c), *(len(row[i]) for row in full)]) for i, c in enumerate(columns)]

    def line(row: Sequence[str]) -> str:
        rest = [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return "| " + " | ".join([row[0].ljust(widths[0]), *rest]) + " |"

    print(line(columns))
    print("|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|")
    for row in cells:
        print(line(row))


def _one_line(res: dict[str, Any]) -> str:
    if res.get("error"):
        return failure_text(res)
    if res["variant"] == "io":
        return f"{res['read_s']:.2f} s, {res['gb_per_s']:.2f} GB/s"
    return (
        f"load {res['load_s']:.1f} s, first {res['first_s']:.2f} s, steady "
        f"{res['steady_s']:.2f} s, {res['tokens_per_s']:.2f} tok/s, peak RSS "
        f"+{(res['peak_rss'] - res['baseline_rss']) / MiB:.0f} MiB, anon "
        f"+{(res['peak_anon'] - res['baseline_anon']) / MiB:.0f} MiB"
    )


def _med(rs: Sequence[dict[str, Any]], key: str | Callable[[dict[str, Any]], float]) -> float:
    get = key if callable(key) else (lambda r: r[key])
    return common.median([get(r) for r in rs])


def _report(
    results: dict[str, list[dict[str, Any]]], plan: Plan, budget: int, notes: list[str]
) -> dict[str, Any]:
    import torch

    ok = {v: [r for r in rs if not r.get("error")] for v, rs in results.items()}
    # The bound is the fastest cold read of all shards, whatever the method and round.
    io_s = min(r["read_s"] for r in ok["io"]) if ok.get("io") else float("nan")
    # Compute likewise: the fastest warm forward in RAM (other processes only slow it down).
    compute_s = min(t for r in ok["ram"] for t in r["steady"]) if ok.get("ram") else None
    bound = max(compute_s, io_s) if compute_s is not None else io_s
    ref_variant = next((v for v in ("ram", "accelerate", *POLICIES) if ok.get(v)), None)
    ref = None
    if ref_variant is not None:
        ref_res = ok[ref_variant][0]
        ref = torch.load(ref_res["cfg"]["logits_path"], weights_only=True)
        ref_tokens = ref_res["tokens"]

    print()
    print(
        f"{plan.params / 1e9:.2f} B params, {plan.total_bytes / GiB:.2f} GiB fp32 in "
        f"{len(plan.shards)} shards; budget {budget / MiB:.0f} MiB; page cache cold before "
        "every forward (a model larger than RAM)"
    )
    columns = [
        "variant",
        "load s",
        "1st fwd s",
        "steady fwd s",
        "generate tok/s",
        "peak RSS +MiB",
        "peak anon +MiB",
        "x I/O bound",
        "x max(compute, I/O)",
        "logits max abs diff",
        "same tokens",
        "cores",
        "others cores",
    ]
    rows: list[list[str]] = []
    summary: dict[str, Any] = {"io_s": io_s, "compute_s": compute_s, "bound_s": bound}
    extra: list[str] = []
    for v, rs in results.items():
        label = _variant_label(v)
        for res in rs:
            if res.get("error"):
                rows.append([label, failure_text(res)])
        good = ok[v]
        if not good:
            continue
        cores, others = common.contention(good)
        load_text = f"{cores:.2f}", f"{others:.2f}"
        if v == "io":
            gbs = plan.total_bytes / io_s / 1e9
            io_row = [label, "-", "-", f"{io_s:.2f}", f"<= {1 / io_s:.2f}", "-", "-"]
            rows.append([*io_row, "1.00x", f"{io_s / bound:.2f}x", "-", "-", *load_text])
            cached = max(r["cached_before"] for r in good)
            methods = {m: min(t for r in good for t in r["reads"][m]) for m in IO_METHODS}
            extra.append(
                f"I/O bound: the fastest cold read of all {plan.total_bytes / GiB:.2f} GiB of "
                f"shards, {io_s:.2f} s = {gbs:.2f} GB/s; best per method: "
                + ", ".join(
                    f"{m} {t:.2f} s ({plan.total_bytes / t / 1e9:.2f} GB/s)"
                    for m, t in methods.items()
                )
                + f"; <= {cached:.1%} of the shards in the page cache after each eviction"
            )
            summary["io"] = {"read_s": io_s, "gb_per_s": gbs, "methods": methods}
            continue
        steady = _med(good, "steady_s")
        peak_rss = max(r["peak_rss"] - r["baseline_rss"] for r in good)
        peak_anon = max(r["peak_anon"] - r["baseline_anon"] for r in good)
        if ref is not None:
            diffs = []
            for r in good:
                got = torch.load(r["cfg"]["logits_path"], weights_only=True)
                diffs.append((got.double() - ref.double()).abs().max().item())
            dmax = max(diffs)
            same = all(r["tokens"] == ref_tokens for r in good)
            dtext, stext = f"{dmax:.1e}", ("yes" if same else "NO")
        else:
            dtext = stext = "-"
        cold = max(max(r["cached_before_forward"]) for r in good)
        rows.append(
            [
                label,
                f"{_med(good, 'load_s'):.2f}",
                f"{_med(good, 'first_s'):.2f}",
                f"{steady:.2f}",
                f"{_med(good, 'tokens_per_s'):.2f}",
                f"{peak_rss / MiB:.0f}",
                f"{peak_anon / MiB:.0f}",
                "-" if v == "ram" else f"{steady / io_s:.2f}x",
                "-" if v == "ram" else f"{steady / bound:.2f}x",
                dtext,
                stext,
                *load_text,
            ]
        )
        summary[v] = {
            "load_s": _med(good, "load_s"),
            "first_s": _med(good, "first_s"),
            "steady_s": steady,
            "tokens_per_s": _med(good, "tokens_per_s"),
            "decode_step_s": _med(good, "decode_step_s"),
            "peak_rss_above": peak_rss,
            "peak_anon_above": peak_anon,
            "run_peak_rss_above": max(r["run_peak_rss"] - r["baseline_rss"] for r in good),
            "run_peak_anon_above": max(r["run_peak_anon"] - r["baseline_anon"] for r in good),
            "x_io": steady / io_s,
            "x_bound": steady / bound,
        }
        s = summary[v]
        extra.append(
            f"{label}: decode {s['decode_step_s']:.2f} s/token; peak during forwards+generate "
            f"RSS +{s['run_peak_rss_above'] / MiB:.0f} MiB, anon "
            f"+{s['run_peak_anon_above'] / MiB:.0f} MiB; baseline RSS "
            f"{good[0]['baseline_rss'] / MiB:.0f} MiB"
            + ("" if v == "ram" else f"; page cache before the forwards <= {cold:.1%}")
        )
        for r in good:
            for note in r.get("notes", []):
                extra.append(f"{label}: {note}")
        res = good[-1]
        for key, when in (("residency_load", "after manage"), ("residency", "forwards+generate")):
            rep = res.get(key)
            if rep:
                extra.append(
                    f"{label} report ({when}): device peak {common.fmt_mib(rep.get('peak_bytes'))}"
                    f" MiB (budget {budget / MiB:.0f}), {rep.get('transfers_count', '-')} moves, "
                    f"{common.fmt_mib(rep.get('transfers_bytes'))} MiB, "
                    f"{rep.get('prefetches', '-')} prefetched; "
                    f"{rep.get('checkpoint_placements')} tensors "
                    f"({common.fmt_mib(rep.get('checkpoint_bytes'))} MiB) read in place from the "
                    f"checkpoint, {rep.get('converted')} converted"
                )
    print_markdown_table(columns, rows)
    print(
        "columns: load = ts.manage(checkpoint=) / load_checkpoint_and_dispatch / from_pretrained; "
        "1st fwd = first forward after the load (Flow records the op order); steady = median of "
        "the next forwards; tok/s = new tokens / generate() wall time (prefill included); peak "
        "RSS / anon (RssAnon) = max sampled over load + forwards + generate minus the value "
        "before the model was built; x I/O bound = steady / the fastest cold read of all "
        "shards; x max(compute, I/O) = steady / the larger of the fastest in-RAM forward and the "
        f"I/O bound; logits = max |logits - {ref_variant}'s| of the first forward; tokens = the "
        f"same generated tokens as {ref_variant}; cores = CPU seconds of the worker / wall "
        "seconds over the timed forwards (reads for the I/O row); others = cores the other "
        "processes used meanwhile (the machine is shared: > 0.25 means noisy timings; rerun "
        "with --quiet-wait 120)"
    )
    for line in notes + extra:
        print(line)
    return summary


if __name__ == "__main__":
    sys.exit(main())
