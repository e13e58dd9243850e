"""``ts.fit`` under FSDP2 against plain FSDP2 and FSDP2 with every block checkpointed (issue 28).

Model: transformers GPT-2 built from a config with random weights, 8 x 256 (4 heads, an
8192-token vocabulary, 128 positions), fp32, dropout on, no KV cache; ``torch.optim.AdamW``
made after sharding; ``loss = model(ids, labels=ids).loss`` on a batch of 8 x 128 tokens per
rank (each rank its own); the loop: forward, backward, ``opt.step()``, ``opt.zero_grad()``.
``fully_shard`` on every block, then on the model (torchtitan's order), gloo, two ranks, each
rank one thread (``torch.set_num_threads(1)``: this machine has two cores).

Variants, each in fresh processes and a fresh process group (this script with ``--worker``,
one process per rank):

* ``plain``: FSDP2 as is.
* ``ckpt``: FSDP2 with every block wrapped by ``checkpoint_wrapper`` before ``fully_shard``
  (torchtitan's full activation checkpointing; random state preserved).
* ``tsckpt``: ``ts.fit`` at ``ckpt``'s per-rank working set.
* ``ts80`` / ``ts60``: ``ts.fit`` at 80% / 60% of ``plain``'s per-rank working set.

Per variant: ``--warmup`` steps (ts.fit: step 1 measures, step 2 re-times, step 3 is recorded),
then ``--groups`` groups of ``--steps`` steps; ``step``: the best group's seconds per step (the
slower rank's). ``working set``: each rank's peak RSS during the timed groups above its RSS
before the model was built (docs/api.md §10: sampled every 2 ms, workers run with
``MALLOC_MMAP_THRESHOLD_=131072`` so freed tensors' pages go back to the OS), the larger of the
two ranks. ``tensors``: a recorded step's tensor peak (ts.record of a warm-up step; for ts.fit,
its measured peak), the larger rank's. ``losses`` and ``weights``: every step's loss on both
ranks and the final full weights, against ``plain``'s (``=``: bit for bit; ``~``: allclose at
rtol 1e-6).

    python benchmarks/fit_distributed.py
    python benchmarks/fit_distributed.py --variants plain,ckpt,tsckpt --explain
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import _offload_common as common

VARIANTS = ("plain", "ckpt", "tsckpt", "ts80", "ts60")
SHARES = {"ts80": 0.8, "ts60": 0.6}
SHAPE = {"layers": 8, "hidden": 256, "heads": 4, "vocab": 8192, "batch": 8, "seq": 128}


def _model(shape: dict[str, Any], checkpointed: bool) -> Any:
    import torch
    import transformers as tf
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(
        tf.GPT2Config(
            n_layer=shape["layers"],
            n_embd=shape["hidden"],
            n_head=shape["heads"],
            vocab_size=shape["vocab"],
            n_positions=shape["seq"],
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
        )
    ).train()
    blocks = model.transformer.h
    if checkpointed:  # torchtitan: the wrapper first, then fully_shard on the wrapped block
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for k in range(len(blocks)):
            blocks[k] = checkpoint_wrapper(blocks[k])
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import tensorscope as ts

    rank = cfg["rank"]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(cfg["port"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        return _train(cfg, rank, ts)
    finally:
        dist.destroy_process_group()


def _train(cfg: dict[str, Any], rank: int, ts: Any) -> dict[str, Any]:
    import torch
    import transformers  # noqa: F401  (imported before the baseline: not the model's memory)
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    common.warm_up_runtime()
    common.settle_memory()
    base_rss = common.rss_bytes()
    shape = cfg["shape"]
    variant = cfg["variant"]
    model = _model(shape, variant == "ckpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fit = None
    if variant.startswith("ts"):
        fit = ts.fit(model, opt, budget=int(cfg["budget"]))
    g = torch.Generator().manual_seed(1000 + rank)
    total = cfg["warmup"] + cfg["groups"] * cfg["steps"]
    batches = [
        torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
        for _ in range(total)
    ]
    losses: list[float] = []

    def step(k: int) -> None:
        torch.manual_seed(k)  # dropout: every variant draws the same masks
        loss = model(batches[k], labels=batches[k]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))

    tensors = None
    for k in range(cfg["warmup"]):
        if fit is None and k == cfg["warmup"] - 1:
            with ts.record() as rec:
                step(k)
            tensors = rec.plan().peak_bytes
        else:
            step(k)
    sampler = common.PeakSampler()
    groups = []
    k = cfg["warmup"]
    for _ in range(cfg["groups"]):
        with sampler:
            start = time.perf_counter()
            for _ in range(cfg["steps"]):
                step(k)
                k += 1
            groups.append((time.perf_counter() - start) / cfg["steps"])
    if fit is not None and fit.plan_after is not None:  # read here: a re-decision (a step
        tensors = fit.measured_peak(fit.plan_after)  # over budget) records again in the groups
    weights = [p.full_tensor().detach().clone() for p in model.parameters()]  # a collective
    if rank == 0:
        torch.save(weights, cfg["weights"])
    result = {
        "variant": variant,
        "rank": rank,
        "groups": groups,
        "working_set": sampler.peak_rss - base_rss,
        "tensors": tensors,
        "losses": losses,
    }
    if fit is not None:
        result["explain"] = fit.explain()
        result["budget"] = fit.budget_bytes
        fit.remove()
    return result


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Both ranks of one variant, each a fresh process; their results merged."""
    port = _free_port()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps({**cfg, "rank": r, "port": port})],
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            return {"variant": cfg["variant"], "error": f"timed out after {timeout_s:.0f} s"}
        found = [line for line in out.splitlines() if line.startswith(common.RESULT_MARKER)]
        if not found:
            return {"variant": cfg["variant"], "error": f"exit status {proc.returncode}"}
        results.append(json.loads(found[-1][len(common.RESULT_MARKER) :]))
    for r in results:
        if "error" in r:
            return r
    per_group = [max(a, b) for a, b in zip(results[0]["groups"], results[1]["groups"], strict=True)]
    return {
        "variant": cfg["variant"],
        "step_s": min(per_group),
        "working_set": max(r["working_set"] for r in results),
        "tensors": max(r["tensors"] or 0 for r in results),
        "losses": [r["losses"] for r in results],
        "explain": results[0].get("explain", ""),
        "budget": results[0].get("budget"),
        "weights": cfg["weights"],
    }


def _compare(result: dict[str, Any], plain: dict[str, Any]) -> tuple[str, str]:
    import torch

    def same(a: Any, b: Any) -> str:
        if all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
            return "="
        ok = all(torch.allclose(x, y, rtol=1e-6, atol=0) for x, y in zip(a, b, strict=True))
        return "~" if ok else "NO"

    losses = same(
        [torch.tensor(x) for x in result["losses"]], [torch.tensor(x) for x in plain["losses"]]
    )
    weights = same(torch.load(result["weights"]), torch.load(plain["weights"]))
    return losses, weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--explain", action="store_true", help="print ts.fit's explain()")
    args = parser.parse_args()
    if args.worker:
        return common.worker_main(_worker, args.worker)
    variants = common.parse_variants(args.variants, VARIANTS)
    needed = {"tsckpt": ["ckpt"], "ts80": ["plain"], "ts60": ["plain"]}
    order = list(dict.fromkeys(["plain"] + [n for v in variants for n in needed.get(v, [])]))
    order += [v for v in variants if v not in order]
    spill = tempfile.TemporaryDirectory(prefix="fit-dist-bench-")
    base = {
        "shape": SHAPE,
        "warmup": max(4, args.warmup),
        "groups": args.groups,
        "steps": args.steps,
    }
    print(
        f"GPT-2 {SHAPE['layers']}x{SHAPE['hidden']}, vocab {SHAPE['vocab']}, batch "
        f"{SHAPE['batch']}x{SHAPE['seq']} per rank, 2 ranks (gloo, one thread each), warmup "
        f"{base['warmup']}, {base['groups']} groups of {base['steps']} steps"
    )
    results: dict[str, dict[str, Any]] = {}
    for variant in order:
        cfg = {**base, "variant": variant, "weights": f"{spill.name}/{variant}.pt"}
        if variant == "tsckpt":
            cfg["budget"] = results["ckpt"]["working_set"]
        elif variant in SHARES:
            cfg["budget"] = int(results["plain"]["working_set"] * SHARES[variant])
        results[variant] = _run(cfg, args.timeout)
        if "error" in results[variant] and variant in ("plain", "ckpt"):
            print(f"{variant} failed: {results[variant]['error']}")
            return 1
    plain = results["plain"]
    rows = []
    for variant in order:
        r = results[variant]
        if "error" in r:
            rows.append([variant, "error: " + str(r["error"])[:200]])
            continue
        losses, weights = _compare(r, plain)
        budget = common.fmt_mib(r["budget"]) if r.get("budget") else ""
        rows.append(
            [
                variant,
                budget,
                common.fmt_mib(r["tensors"]),
                common.fmt_mib(r["working_set"]),
                f"{r['step_s']:.3f} s ({r['step_s'] / plain['step_s']:.2f}x)",
                losses,
                weights,
            ]
        )
    common.print_table(
        [
            ("variant", ""),
            ("budget", "MiB"),
            ("tensors", "MiB"),
            ("working set", "MiB"),
            ("step", "s (x plain)"),
            ("losses", "vs plain"),
            ("weights", "vs plain"),
        ],
        rows,
    )
    if "ckpt" in results and "tsckpt" in results and "error" not in results["tsckpt"]:
        ratio = results["tsckpt"]["step_s"] / results["ckpt"]["step_s"]
        print(f"tsckpt / ckpt step time: {ratio:.2f}x (target <= 0.90x)")
    if "ts60" in results and "error" not in results["ts60"]:
        print(f"ts60 / plain step time: {results['ts60']['step_s'] / plain['step_s']:.2f}x "
              f"(target <= 1.15x)")  # fmt: skip
    if args.explain:
        for variant in order:
            text = results[variant].get("explain")
            if text:
                print(f"\n{variant}:\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
