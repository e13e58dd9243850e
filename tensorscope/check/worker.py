"""Checks in a process apart from the runner: ``python -m tensorscope.check.worker --checks JSON
--device D --size S --out-dir DIR``.

Its own process gives a check a fresh caching allocator and fresh cuBLAS handles (baselines
one check cannot disturb for another: on CUDA each check gets a worker of its own), and lets
the runner kill a check that runs out of time. Each check's result file ``DIR/NAME.json`` is
rewritten after every finding (``Context.save``) and finally with its status: ``pass`` (every
expectation held), ``fail``, or ``error`` (an exception: its traceback).

Layer: the check package.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import traceback
from collections.abc import Sequence
from importlib import metadata
from typing import Any

__all__ = ["environment", "main", "run_check"]


def environment() -> dict[str, Any]:
    """What ran the checks: versions, the engines, the device's name."""
    import torch

    from tensorscope._engine import engine_name
    from tensorscope._torch import STORAGE_DOOR

    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "engine": engine_name(),
        "storage_door": STORAGE_DOOR or "missing",
    }
    for package in ("transformers", "accelerate"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "missing"
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["cuda"] = torch.version.cuda
    return found


def run_check(target: str, device: Any, size: str, out: str) -> str:
    """Run the check ``MODULE:FUNCTION`` and write its result to ``out``; its status."""
    from tensorscope.check.context import Context

    ctx = Context(device, size, out)
    env = environment()
    ctx.save(status="running", environment=env, device=str(device))
    module_name, _, function = target.partition(":")
    status, trace = "pass", None
    try:
        check = getattr(importlib.import_module(module_name), function)
        check(ctx)
    except BaseException:  # reported, never raised: the other checks go on
        status, trace = "error", traceback.format_exc()
        print(trace, file=sys.stderr, flush=True)
    else:
        if not all(row["ok"] for row in ctx.rows):
            status = "fail"
        elif not ctx.rows:
            status, trace = "error", "the check recorded no expectation"
    ctx.save(status=status, traceback=trace, environment=env, device=str(device))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorscope.check.worker")
    parser.add_argument("--checks", required=True, help="JSON: [[name, title, target], ...]")
    parser.add_argument("--device", required=True)
    parser.add_argument("--size", required=True, choices=("full", "small"))
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)

    import torch

    device = torch.device(args.device)
    failed = 0
    for name, title, target in json.loads(args.checks):
        print(f"== {name}: {title}", flush=True)
        status = run_check(target, device, args.size, os.path.join(args.out_dir, f"{name}.json"))
        failed += status != "pass"
    sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
