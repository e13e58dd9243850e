"""The arguments of ``tensorscope check`` (also ``python -m tensorscope.check``).

Layer: the check package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from tensorscope.check.runner import CHECKS, run_checks

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = [spec.name for spec in CHECKS]
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="where to run (default: CUDA when present, else the CPU)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results there (JSON)")
    parser.add_argument(
        "--size",
        choices=("auto", "full", "small"),
        default="auto",
        help="the acceptance shapes (full, minutes on a GPU) or small ones (seconds); "
        "default: full on CUDA, small on the CPU",
    )
    parser.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        choices=names,
        help=f"run only this check (repeatable): {', '.join(names)}",
    )
    parser.add_argument(
        "--isolate",
        choices=("auto", "each", "shared"),
        default="auto",
        help="a process per check (each) or one for all, started again after a crash or a "
        "timeout (shared); default: each on CUDA, shared on the CPU",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        metavar="SECONDS",
        help="for the whole run (checks not started in time are reported as timed out); "
        "default 480 at full size",
    )


def run(args: Any) -> int:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                "tensorscope check: --device cuda, but torch sees no CUDA device "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False); nothing ran.",
                file=sys.stderr,
            )
            return 2
    chosen = [spec for spec in CHECKS if not args.only or spec.name in args.only]
    report = run_checks(chosen, args.device, args.size, args.json, args.time_limit, args.isolate)
    return 0 if report["passed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tensorscope.check",
        description="Check tensorscope's contract on this machine's best device (API §12).",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
