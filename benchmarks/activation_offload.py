"""Activation offload (``tensorscope.fit.offload``) on a GPT-2-shaped training step, CPU.

Model: transformers GPT-2 from a config with random weights (seed 0): ``--layers`` (8) x
``--hidden`` (256), 4 heads, GPT-2's 50257-word vocabulary, 256 positions; AdamW(lr=1e-4); a
batch of ``--batch`` (8) x ``--seq`` (256) random tokens (seed 1) with labels = inputs; dropout on
(``torch.manual_seed(step)`` before each step, the same masks in every variant).

Variants, each in a fresh process:

* ``plain``: the step as is.
* ``offload``: ``offload_blocks(model.transformer.h)``: every block's saved tensors of 1 MiB or
  more go to the disk tier (private offload directory under TMPDIR) and come back for backward.
* ``checkpoint``: transformers' ``gradient_checkpointing_enable()`` (every block, non-reentrant).
* ``checkpoint+offload``: both: what the checkpoint keeps, each block's input, is offloaded.
* ``offload-notrim``: ``offload`` without giving the C heap back after each block's writes
  (``trim_heap=False``): how much of the drop is the trim.
* ``measure``: ``offload_blocks(..., measure_only=True)``: the hooks and decisions, no I/O.
* ``trim``: plain, with the same heap trim after each block's forward (no offload): how much
  of the drop the trim alone gives.

Per variant: RSS before the model is built is the baseline; RSS is sampled every 2 ms during the
steps after the first (which creates AdamW's state); "peak" is the highest RSS minus the
baseline: parameters, gradients, Adam state, activations, temporaries, allocator slack. Step
time: median of those steps. Losses are compared with plain's for exact equality. For offload
variants, the offloader's counters of the last step: bytes written, write and read bandwidth,
seconds the forward waited for the writer and the backward for reads, and its own peak of
offloadable bytes held in memory (``OffloadStats.peak_ram_bytes``).

Run: ``python benchmarks/activation_offload.py`` (``--quick``: 3 steps, one round). The exit
status is non-zero only on errors (mismatched losses included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import _offload_common as common

VARIANTS = (
    "plain",
    "offload",
    "checkpoint",
    "checkpoint+offload",
    "offload-notrim",
    "measure",
    "trim",
)


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(cfg["threads"])
    common.warm_up_runtime()
    import transformers as tf

    from tensorscope.fit.offload import offload_blocks

    common.settle_memory()
    baseline = common.rss_bytes()
    config = tf.GPT2Config(
        n_layer=cfg["layers"], n_embd=cfg["hidden"], n_head=4, n_positions=cfg["seq"]
    )
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config)
    model.train()
    variant = cfg["variant"]
    if "checkpoint" in variant:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    handle = None
    if "offload" in variant:
        handle = offload_blocks(model.transformer.h, trim_heap=variant != "offload-notrim")
    elif variant == "measure":
        handle = offload_blocks(model.transformer.h, measure_only=True)
    elif variant == "trim":  # plain, with offload's heap trim after each block's forward
        from tensorscope.residency.tiers import free_heap_bytes, release_free_heap

        def trim(*_: Any) -> None:
            if free_heap_bytes() >= 64 * common.MiB:
                release_free_heap()

        for block in model.transformer.h:
            block.register_forward_hook(trim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(
        0, config.vocab_size, (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(1)
    )
    sampler = common.PeakSampler()
    losses: list[float] = []
    times: list[float] = []
    offload: dict[str, Any] = {}
    for step in range(cfg["steps"]):
        torch.manual_seed(step)
        if handle is not None:
            handle.offloader.reset_peak()
            before = handle.stats()
        start = time.perf_counter()
        if step > 0:
            sampler.__enter__()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > 0:
            sampler.__exit__(None, None, None)
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
        del loss
        if handle is not None:
            after = handle.stats()
            offload = {
                "written_mib": (after.bytes_written - before.bytes_written) / common.MiB,
                "read_mib": (after.bytes_read - before.bytes_read) / common.MiB,
                "write_gbs": (after.bytes_written - before.bytes_written)
                / max(after.write_s - before.write_s, 1e-9)
                / 1e9,
                "read_gbs": (after.bytes_read - before.bytes_read)
                / max(after.read_s - before.read_s, 1e-9)
                / 1e9,
                "pack_wait_s": after.pack_wait_s - before.pack_wait_s,
                "unpack_wait_s": after.unpack_wait_s - before.unpack_wait_s,
                "sync_reads": after.sync_reads - before.sync_reads,
                "held_peak_mib": after.peak_ram_bytes / common.MiB,
                "trims": after.trims - before.trims,
                "kept_mib": sum(g.kept_bytes for g in after.groups.values()) / common.MiB,
            }
    if handle is not None:
        handle.remove()
    return {
        "variant": variant,
        "losses": losses,
        "peak_mib": (sampler.peak_rss - baseline) / common.MiB,
        "step_s": statistics.median(times),
        "offload": offload,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        return common.worker_main(_worker, args.worker)
    if args.quick:
        args.steps, args.rounds = 3, 1
    variants = common.parse_variants(args.variants, VARIANTS)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for order in common.round_orders(variants, args.rounds):
        for variant in order:
            cfg = {**vars(args), "variant": variant, "worker": None}
            run = common.run_worker(__file__, cfg, timeout_s=1800)
            if not run.ok:
                print(f"{variant}: {run.error}", file=sys.stderr)
                return 1
            results[variant].append(run.result)
    reference = results.get("plain")
    status = 0
    rows = []
    plain_time = statistics.median(r["step_s"] for r in reference) if reference else None
    plain_peak = statistics.median(r["peak_mib"] for r in reference) if reference else None
    for variant in variants:
        rs = results[variant]
        same = reference is None or all(r["losses"] == reference[0]["losses"] for r in rs)
        status |= 0 if same else 1
        peak = statistics.median(r["peak_mib"] for r in rs)
        step = statistics.median(r["step_s"] for r in rs)
        off = rs[-1]["offload"]
        rows.append(
            [
                variant,
                f"{peak:.0f}" + (f" ({peak / plain_peak:.2f}x)" if plain_peak else ""),
                f"{step:.3f}" + (f" ({step / plain_time:.2f}x)" if plain_time else ""),
                "yes" if same else "NO",
                f"{off['written_mib']:.0f}" if off else "-",
                f"{off['write_gbs']:.2f}/{off['read_gbs']:.2f}" if off else "-",
                f"{off['pack_wait_s']:.3f}/{off['unpack_wait_s']:.3f}" if off else "-",
                f"{off['held_peak_mib']:.0f}" if off else "-",
            ]
        )
    common.print_table(
        [
            ("variant", ""),
            ("peak RSS", "MiB (x plain)"),
            ("step", "s (x plain)"),
            ("losses", "= plain"),
            ("written", "MiB/step"),
            ("write/read", "GB/s"),
            ("waits fwd/bwd", "s"),
            ("held peak", "MiB"),
        ],
        rows,
    )
    shape = f"GPT-2 {args.layers}x{args.hidden}, batch {args.batch}x{args.seq}"
    print(f"{shape}; {args.steps} steps x {args.rounds} rounds; median of steps 2..N")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
