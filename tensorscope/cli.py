"""The ``tensorscope`` command: ``tensorscope demo``, ``tensorscope plan script.py``,
``tensorscope check``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

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
    _add_plan(commands)
    check = commands.add_parser(
        "check",
        help="check tensorscope's contract on this machine's best device (minutes on a GPU)",
        description="Run the acceptance checks of tensorscope's contract (API §12) on the best "
        "device present, each in a process of its own under a time limit, and print a table "
        "(docs/accelerators.md). The exit status is 0 only when every check passed.",
    )
    from tensorscope.check.cli import add_arguments as add_check_arguments

    add_check_arguments(check)
    words = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if words[:1] == ["plan"] and "--" in words:  # what follows -- is the script's own
        cut = words.index("--")
        words, script_args = words[:cut], words[cut + 1 :]
    args = parser.parse_args(words)
    if args.command == "plan":
        args.script_args = script_args
        return _plan(parser, args)
    if args.command == "check":
        from tensorscope.check.cli import run as run_check

        return run_check(args)
    if args.command == "demo":
        if args.batches < 1 or args.forwards < 1:
            parser.error("--batches and --forwards must be at least 1")
        from tensorscope import demo as demo_module

        return demo_module.main(batches=args.batches, forwards=args.forwards, parts=args.part)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse catches it
    return 2


def _add_plan(commands: Any) -> None:
    plan = commands.add_parser(
        "plan",
        help="record one training step of a script: step.png and a summary of its memory",
        description=(
            "Run a training script and record one of its steps (by default the second: from "
            "the end of the first optimizer.step() to the end of the second), then write the "
            "memory picture and print where the bytes went (docs/plan.md). No code change: "
            "the step ends at optimizer.step(); or name a function that runs one step."
        ),
    )
    plan.add_argument(
        "script",
        nargs="?",
        help="the training script (python file); its own arguments go after --: "
        "tensorscope plan train.py -- --epochs 1",
    )
    plan.add_argument(
        "--step",
        metavar="MODULE:FUNCTION",
        help="record one call of this function (no arguments; one step) instead",
    )
    plan.add_argument(
        "--iteration", type=int, default=2, help="which optimizer step to record (default 2)"
    )
    plan.add_argument(
        "--warmup", type=int, default=1, help="calls of --step before the recorded one (1)"
    )
    plan.add_argument("--out", default="step.png", help="the picture (default step.png)")
    plan.add_argument("--snapshot", help="also write a memory_viz snapshot (.pickle) here")
    plan.add_argument(
        "--run-to-end", action="store_true", help="let the script finish after the step"
    )


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.script is None and args.step is None:
        parser.error("plan: give a script, or --step module:function")
    if args.iteration < 1 or args.warmup < 0:
        parser.error("plan: --iteration must be at least 1 and --warmup at least 0")
    from tensorscope.errors import TensorScopeError
    from tensorscope.plan.script import plan_function, plan_script

    try:
        if args.step is not None:
            plan = plan_function(args.script, args.step, args.script_args, warmup=args.warmup)
            what = f"one call of {args.step}"
        else:
            plan, number = plan_script(
                args.script,
                args.script_args,
                iteration=args.iteration,
                run_to_end=args.run_to_end,
            )
            what = f"optimizer step {number} of {args.script}"
    except TensorScopeError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"tensorscope plan: recorded {what}")
    print(plan)
    status = 0
    try:
        plan.save_png(args.out)
        print(f"wrote {args.out}")
    except (ImportError, TensorScopeError) as error:
        print(error, file=sys.stderr)
        status = 1
    if args.snapshot:
        try:
            plan.save_snapshot(args.snapshot)
            print(f"wrote {args.snapshot} (open it at https://pytorch.org/memory_viz)")
        except TensorScopeError as error:
            print(error, file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
