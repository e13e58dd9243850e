"""ts.fit against plain and HF checkpointing in one process, steps alternating (issue 27).

This VM's timings drift 20-40% between runs minutes apart, so ``fit_training.py``'s fresh
processes compare variants measured at different moments. Here every variant is a twin of one
model (same seed), stepped in turn, so drift hits them all alike: plain, HF checkpointing of
every block, and ``ts.fit`` at each budget given, with blocks kept selectively allowed (``ts``)
and not (``ts-nofs``: every block kept, recomputed or offloaded whole). Memory is not measured
here (one process holds every twin): ``fit_training.py`` measures it. Dropout draws from one
global stream, so losses differ between twins; ``fit_training.py`` checks the bits.

    python benchmarks/fit_side_by_side.py --budgets 559,237 --steps 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

import tensorscope as ts

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import fit_training


def _twin(shape: dict[str, Any], kind: str, budget: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = fit_training._model(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if kind == "hf1":
        model.gradient_checkpointing_enable()
    fit = None
    if kind.startswith("ts"):
        fit = ts.fit(model, opt, budget=budget)
        assert fit.chain is not None
        fit.chain.selective = kind == "ts"
    return model, opt, fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "gpt2-124m", "llama"))
    parser.add_argument("--budgets", default="559,237", help="MiB, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after 7 warm-up)")
    args = parser.parse_args()
    shape = fit_training._config(False, args.model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
    twins = {"plain": _twin(shape, "plain", 0), "hf1": _twin(shape, "hf1", 0)}
    for mib in args.budgets.split(","):
        budget = int(float(mib) * 2**20)
        for kind in ("ts", "ts-nofs"):
            twins[f"{kind}@{mib}"] = _twin(shape, kind, budget)
    times: dict[str, list[float]] = {name: [] for name in twins}
    warmup = 7  # a fit measures, re-times, records, and checks its prediction in these
    for k in range(warmup + args.steps):
        for name, (model, opt, _) in twins.items():
            start = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            if k >= warmup:
                times[name].append(time.perf_counter() - start)
        print(f"  step {k + 1} done", file=sys.stderr, flush=True)
    plain = statistics.median(times["plain"])
    hf1 = statistics.median(times["hf1"])
    print(f"{args.model}: median of {args.steps} steps after {warmup}, twins alternating")
    print(f"{'variant':<14} {'step s':>7} {'x plain':>8} {'x hf1':>7}  blocks")
    for name, (_, _, fit) in twins.items():
        t = statistics.median(times[name])
        blocks = ""
        if fit is not None and fit.decision is not None:
            blocks = " ".join(b[:3] for b in fit.decision.blocks)
        print(f"{name:<14} {t:>7.3f} {t / plain:>7.2f}x {t / hf1:>6.2f}x  {blocks}")


if __name__ == "__main__":
    main()
