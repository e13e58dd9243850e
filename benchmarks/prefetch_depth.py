"""Flow's prefetch depth: the measured pace (the default) against fixed counts, side by side.

One checkpoint made by ``bigger_than_ram.py`` (``--dir``), the variants interleaved round by round
(the order reversed every other round) so that drift of the machine hits them alike. Each run is
a fresh process: it builds the model on the meta device, ``ts.manage(model, checkpoint=...)``,
and times the first forward (nothing recorded yet: no prediction) and two steady forwards,
evicting the checkpoint from the page cache before each (a model larger than RAM). It exits
without ``remove()``, which would need the whole model in RAM.

    python benchmarks/bigger_than_ram.py --quick --skip-accelerate --policies flow  # makes it
    python benchmarks/prefetch_depth.py --dir /tmp/tensorscope-bigger-than-ram-quick \\
        --budget 256MiB --rounds 6

Prints the median and minimum of each variant and its ratio to the paced default. The first
forward predicts nothing for any variant (they differ only once an iteration is recorded): its
spread between variants is the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offload_inference import _evict_page_cache as evict_page_cache

import tensorscope as ts

VARIANTS: dict[str, int | None] = {"paced (default)": None, "fixed 4": 4, "fixed 1": 1}


def one_run(directory: str, budget: str, limit: int | None, threads: int) -> list[float]:
    """Times of the first and two steady forwards (in this process; see ``run_child``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(directory)
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    torch.randn(256, 256) @ torch.randn(256, 256)  # load the BLAS before the clock runs
    with ts.empty_init():
        model = AutoModelForCausalLM.from_config(config).eval()
    ts.residency.configure(device="cpu", policy=ts.Flow(prefetch_limit=limit), budget=budget)
    ts.manage(model, checkpoint=directory)
    times = []
    with torch.no_grad():
        for _ in range(3):
            evict_page_cache(directory)
            started = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - started)
    return times


def run_child(args: argparse.Namespace, limit: int | None) -> list[float]:
    command = [
        sys.executable,
        __file__,
        "--dir",
        args.dir,
        "--budget",
        args.budget,
        "--threads",
        str(args.threads),
        "--child",
        "none" if limit is None else str(limit),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"a run failed:\n{done.stderr[-3000:]}")
    times: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a checkpoint made by bigger_than_ram.py")
    parser.add_argument("--budget", default="256MiB", help="the residency budget")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each variant")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one run: "none" or a fixed limit
    args = parser.parse_args()
    if args.child is not None:
        limit = None if args.child == "none" else int(args.child)
        print(json.dumps(one_run(args.dir, args.budget, limit, args.threads)), flush=True)
        os._exit(0)  # no remove(): it would bring the whole model into RAM
    results: dict[str, dict[str, list[float]]] = {
        name: {"first": [], "steady": []} for name in VARIANTS
    }
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            first, *steady = run_child(args, VARIANTS[name])
            results[name]["first"].append(first)
            results[name]["steady"].extend(steady)
            print(f"round {r} {name:16s} first {first:.2f} s, steady {steady}", flush=True)
    paced = results[next(iter(VARIANTS))]
    base: dict[str, Any] = {k: statistics.median(v) for k, v in paced.items()}
    print(f"\n{args.dir}, budget {args.budget}, {args.rounds} rounds, cold page cache")
    print("| variant | first fwd median (min) s | x paced | steady fwd median (min) s | x paced |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        first, steady = statistics.median(runs["first"]), statistics.median(runs["steady"])
        print(
            f"| {name} | {first:.2f} ({min(runs['first']):.2f}) | {first / base['first']:.2f}x "
            f"| {steady:.2f} ({min(runs['steady']):.2f}) | {steady / base['steady']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
