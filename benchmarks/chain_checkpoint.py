"""Rotor checkpointing of a real model's block chain vs plain and HF's every-block checkpointing.

Model: transformers GPT-2 built from a config with random weights (default: the 124M shape,
12 x 768, 12 heads, 50257-token vocabulary; ``--quick``: 6 x 256, 4 heads, an 8192-token
vocabulary), fp32, dropout on, no KV cache, ``torch.optim.AdamW``, a batch of ``--batch`` x
``--seq`` random tokens (default 2 x 256), ``loss = model(ids, labels=ids).loss``.

Variants, each in a fresh process (the same script with ``--worker``), rounds interleaved:

* ``plain``: the step as is.
* ``hf``: ``model.gradient_checkpointing_enable()`` (every block recomputed once).
* ``ts60`` / ``ts40``: ``tensorscope.checkpoint.checkpoint_chain(model, mem_limit=...)`` at
  60% / 40% of plain's activation memory.
* ``ts_hf``: the same at HF's every-block activation memory.
* ``ts60_blocks`` / ``ts40_blocks``: 60% / 40% of the blocks' share of it, the loss window kept
  whole (what checkpointing the blocks can act on).

Budgets. A calibration process measures the chain once (``checkpoint_chain`` with no limit:
per-block sizes and times) and the *loss window* -- what the model allocates between the last
block's forward and its backward (final norm, LM head, logits, cross-entropy and their
gradients) -- with tensorscope's storage tracker around a plain step. In tensorscope's memory
model (docs/checkpoint.md), with ``loss_tmp_nbytes`` = the loss window, plain's activation
memory is the store-all peak of the chain and HF's is the peak of the every-block schedule.

Measured, per variant: ``--warmup`` steps (tensorscope's first step measures the chain, its
second re-times it), then ``--steps`` timed steps: wall and CPU seconds per step and the CPU
seconds other processes used meanwhile (the machine is shared), ratios of the medians; the
losses of every step, compared with plain's bit for bit; ``tensors``: the peak of live tensor
bytes one more step allocates (activations, gradients, temporaries; not the parameters or
Adam's state, which exist before), counted exactly by tensorscope's storage tracker; ``peak
RSS`` of the process during the timed steps above its RSS before the model was built
(parameters and Adam's state included; glibc keeps freed heap memory, so RSS follows the
allocator's history as well as the tensors).

    python benchmarks/chain_checkpoint.py             # the 124M shape: long on 2 cores
    python benchmarks/chain_checkpoint.py --quick     # a smaller GPT-2: 10 minutes on the
                                                      # shared 2-core machine (docs/checkpoint.md)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

import _offload_common as common

VARIANTS = ("plain", "hf", "ts60", "ts40", "ts_hf", "ts60_blocks", "ts40_blocks")
BUDGETS = {"ts60": 0.6, "ts40": 0.4}
BLOCK_BUDGETS = {"ts60_blocks": 0.6, "ts40_blocks": 0.4}
MODEL_SEED = 0
DATA_SEED = 1


# --------------------------------------------------------------------------- worker


def _model(cfg: dict[str, Any]) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(MODEL_SEED)
    config = GPT2Config(
        n_layer=cfg["layers"],
        n_embd=cfg["width"],
        n_head=cfg["heads"],
        vocab_size=cfg["vocab"],
        n_positions=max(1024, cfg["seq"]),
        use_cache=False,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    return model


def _batch(cfg: dict[str, Any]) -> Any:
    import torch

    g = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)


def _loss_window(model: Any, ids: Any) -> int:
    """Bytes the model allocates between the last block's forward and its backward, above
    what is alive when the last block returns (tracked over one plain step)."""
    from tensorscope.checkpoint.tracker import StorageTracker

    last = model.transformer.h[-1]
    tracker = StorageTracker()
    marks: dict[str, int] = {}

    def forward_end(*_: Any) -> None:
        marks["live"], marks["start"] = tracker.live_nbytes, len(tracker._log)

    def backward_start(*_: Any) -> None:
        marks.setdefault("stop", len(tracker._log))

    hooks = [
        last.register_forward_hook(forward_end),
        last.register_full_backward_pre_hook(backward_start),
    ]
    with tracker:
        model(ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    tracker.close()
    live = peak = marks["live"]
    for _, delta in tracker._log[marks["start"] : marks["stop"]]:
        live += delta
        peak = max(peak, live)
    model.zero_grad(set_to_none=True)
    return peak - marks["live"]


def calibrate(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from tensorscope.checkpoint import checkpoint_chain, min_memory, simulate, store_all_memory
    from tensorscope.checkpoint.blockprobe import every_block_ops

    torch.set_num_threads(cfg["threads"])
    model, ids = _model(cfg), _batch(cfg)
    x_l = cfg["batch"] * cfg["seq"] * cfg["width"] * 4
    loss_tmp = max(0, _loss_window(model, ids) - x_l)  # the model counts d[L] itself
    with checkpoint_chain(model, loss_tmp_nbytes=loss_tmp) as chained:
        for _ in range(2):  # measure, then re-time
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        chain = chained.chain()
        reserve = chained.reserved_nbytes
        n = chain.length
        return {
            "loss_tmp": loss_tmp,
            "reserve": reserve,
            "store_all": store_all_memory(chain) + reserve,
            "every_block": simulate(chain, every_block_ops(n)).peak + reserve,
            "least": min_memory(chain) + reserve,
            "x": chain.x_sizes[1],
            "xbar": chain.xbar_sizes[1],
            "fw_s": chain.fw[0],
            "bw_s": chain.bw[0],
        }


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg["variant"] == "calibrate":
        return calibrate(cfg)
    import torch

    from tensorscope.errors import ScheduleError

    torch.set_num_threads(cfg["threads"])
    common.warm_up_runtime()
    common.settle_memory()
    baseline = common.rss_bytes()
    model, ids = _model(cfg), _batch(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    chained = None
    if cfg["variant"] == "hf":
        model.gradient_checkpointing_enable()
    elif cfg["variant"].startswith("ts"):
        from tensorscope.checkpoint import checkpoint_chain

        chained = checkpoint_chain(model, mem_limit=cfg["limit"], loss_tmp_nbytes=cfg["loss_tmp"])
    sampler = common.PeakSampler()
    losses: list[str] = []
    walls: list[float] = []
    cpus: list[float] = []
    others: list[float] = []
    rest = 0
    for i in range(cfg["warmup"] + cfg["steps"]):
        timed = i >= cfg["warmup"]
        if timed and not rest:
            common.settle_memory()
            rest = common.rss_bytes()
        torch.manual_seed(100 + i)
        try:
            with common.Window() as w, sampler if timed else contextlib.nullcontext():
                loss = model(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        except ScheduleError as err:
            return {"variant": cfg["variant"], "skipped": str(err)}
        losses.append(float(loss.detach()).hex())
        if timed:
            walls.append(w.wall)
            cpus.append(w.cpu)
            others.append(w.others)
    # one more step under tensorscope's storage tracker: the exact peak of live tensor bytes
    # the step allocates (activations, gradients, temporaries; not the parameters or Adam's
    # state, which exist before), independent of how the allocator holds memory (RSS)
    from tensorscope.checkpoint.tracker import StorageTracker

    torch.manual_seed(100 + len(losses))
    with StorageTracker() as tracker:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tracker.close()
    out: dict[str, Any] = {
        "variant": cfg["variant"],
        "tensor_peak": tracker.peak_nbytes,
        "baseline": baseline,
        "rest": rest,
        "peak": sampler.peak_rss,
        "walls": walls,
        "cpus": cpus,
        "others": others,
        "losses": losses,
        "checksum": common.state_checksum(model),
    }
    if chained is not None and chained.schedule is not None:
        out["predicted_peak"] = chained.schedule.peak + chained.reserved_nbytes
        chain = chained.chain()
        plain_s = sum(chain.fw) + sum(chain.bw)
        out["predicted_extra"] = chained.schedule.time / plain_s - 1.0
        out["explain"] = chained.explain()
        chained.remove()
    return out


# --------------------------------------------------------------------------- parent


def _config(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        shape = {"layers": 6, "width": 256, "heads": 4, "vocab": 8192, "batch": 4, "seq": 128}
    else:
        shape = {"layers": 12, "width": 768, "heads": 12, "vocab": 50257}
        shape.update(batch=args.batch, seq=args.seq)
    return {
        **shape,
        "threads": args.threads,
        "warmup": args.warmup,
        "steps": 2 if args.quick else args.steps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, VARIANTS, rounds=1)
    parser.add_argument("--quick", action="store_true", help="a smaller GPT-2, 2 timed steps")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args = parser.parse_args()
    if args.worker is not None:
        return common.worker_main(worker, args.worker)
    variants = common.parse_variants(args.variants, VARIANTS)
    base = _config(args)
    print(
        f"GPT-2 {base['layers']} x {base['width']} ({base['heads']} heads, vocab "
        f"{base['vocab']}), fp32, AdamW, batch {base['batch']} x {base['seq']}, "
        f"{base['threads']} threads, {base['warmup']} warm-up + {base['steps']} timed steps, "
        f"{args.rounds} round(s); {time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    cal = common.run_worker(__file__, {**base, "variant": "calibrate"}, args.timeout)
    if not cal.ok:
        print(f"calibration failed: {cal.error}")
        return 1
    c = cal.result
    mib = common.MiB
    print(
        f"chain (tensorscope's model): block x {c['x'] / mib:.1f} MiB, xbar {c['xbar'] / mib:.1f}"
        f" MiB, fw {c['fw_s'] * 1e3:.0f} ms, bw {c['bw_s'] * 1e3:.0f} ms; loss window "
        f"{c['loss_tmp'] / mib:.0f} MiB; activation memory: plain {c['store_all'] / mib:.0f} "
        f"MiB, HF every-block {c['every_block'] / mib:.0f} MiB, least {c['least'] / mib:.0f} MiB",
        flush=True,
    )
    limits = {name: int(frac * c["store_all"]) for name, frac in BUDGETS.items()}
    blocks = c["store_all"] - c["loss_tmp"]
    for name, frac in BLOCK_BUDGETS.items():
        limits[name] = int(frac * blocks) + c["loss_tmp"]
    limits["ts_hf"] = c["every_block"]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for order in common.round_orders(variants, args.rounds):
        for variant in order:
            cfg = {**base, "variant": variant, "limit": limits.get(variant)}
            cfg["loss_tmp"] = c["loss_tmp"]
            run = common.run_worker(__file__, cfg, args.timeout)
            if run.result.get("skipped"):
                print(f"  {variant}: {run.result['skipped']}", flush=True)
                continue
            if not run.ok:
                print(f"  {variant}: {run.error}", flush=True)
                continue
            results[variant].append(run.result)
            print(f"  {variant}: {common.median(run.result['walls']):.2f} s/step", flush=True)
    _report(variants, results, limits)
    return 0


def _report(
    variants: list[str], results: dict[str, list[dict[str, Any]]], limits: dict[str, int]
) -> None:
    def med(variant: str, key: str) -> float:
        return common.median([v for r in results.get(variant, []) for v in r[key]])

    plain_wall, plain_cpu = med("plain", "walls"), med("plain", "cpus")
    hf_wall, hf_cpu = med("hf", "walls"), med("hf", "cpus")
    plain_losses = results["plain"][0]["losses"] if results.get("plain") else None
    rows = []
    for v in variants:
        runs = results.get(v, [])
        if not runs:
            rows.append([v, "no result"])
            continue
        r = runs[0]
        tensor_peak = common.median([x["tensor_peak"] for x in runs])
        wall, cpu = med(v, "walls"), med(v, "cpus")
        same = "-" if plain_losses is None else str(all(x["losses"] == plain_losses for x in runs))
        rows.append(
            [
                v,
                common.fmt_mib(limits.get(v)),
                common.fmt_mib(r.get("predicted_peak")),
                common.fmt_mib(tensor_peak),
                common.fmt_mib(common.median([x["peak"] - x["baseline"] for x in runs])),
                f"{wall:.2f}",
                f"{wall / plain_wall:.3f}",
                f"{wall / hf_wall:.3f}" if hf_wall == hf_wall else "-",
                f"{cpu / plain_cpu:.3f}",
                f"{cpu / hf_cpu:.3f}" if hf_cpu == hf_cpu else "-",
                f"{common.median([o for x in runs for o in x['others']]):.1f}",
                same,
            ]
        )
    print()
    common.print_table(
        [
            ("variant", ""),
            ("limit", "MiB"),
            ("predicted", "MiB"),
            ("tensors", "MiB peak"),
            ("peak RSS", "MiB above start"),
            ("step", "s wall"),
            ("/plain", "wall"),
            ("/hf", "wall"),
            ("/plain", "cpu"),
            ("/hf", "cpu"),
            ("others", "cpu-s"),
            ("losses = plain", ""),
        ],
        rows,
    )
    for v in variants:
        for r in results.get(v, [])[:1]:
            if "explain" in r:
                print(f"\n{v}: predicted extra time {r['predicted_extra'] * 100:+.1f}%")
                lines = r["explain"].splitlines()
                print("\n".join(lines[:3] + [ln for ln in lines if ln.startswith("ops")]))


if __name__ == "__main__":
    sys.exit(main())
