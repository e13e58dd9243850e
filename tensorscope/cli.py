"""The ``tensorscope`` command: ``tensorscope demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tensorscope",
        description="Explicit, deterministic control over PyTorch tensor memory.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="measure memory saved vs plain PyTorch on this machine (a few minutes)"
    )
    demo.add_argument(
        "--batches", type=int, default=40, help="batches of the leaking loop (default 40)"
    )
    demo.add_argument(
        "--forwards", type=int, default=3, help="timed forwards of the offload part (default 3)"
    )
    demo.add_argument(
        "--part",
        choices=("all", "scopes", "offload"),
        default="all",
        help="which part to run (default: both)",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.batches < 1 or args.forwards < 1:
            parser.error("--batches and --forwards must be at least 1")
        from tensorscope import demo as demo_module

        return demo_module.main(batches=args.batches, forwards=args.forwards, parts=args.part)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse catches it
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
