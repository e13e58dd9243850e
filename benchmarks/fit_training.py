"""``ts.fit`` against plain training and its peers, on the step's working set (issue 27).

Model: transformers, built from a config with random weights, fp32, no KV cache,
``torch.optim.AdamW``; the user's loop: ``loss = model(ids, labels=ids).loss``, backward,
``opt.step()``, ``opt.zero_grad()``. ``--model``:

* ``gpt2`` (default): the issue's GPT-2, 8 x 256, 4 heads, 4096-token vocabulary, batch 8 x 256,
  dropout on (``--quick``: 4 x 128, batch 4 x 128);
* ``gpt2-124m``: GPT-2 124M, 12 x 768, 50257-token vocabulary, batch 2 x 256 (``--quick``:
  6 x 256, 8192-token vocabulary, batch 8 x 128);
* ``llama``: SmolLM-135M's shape, 30 x 576, 9 heads over 3, tied 49152-token vocabulary, batch
  2 x 256 (``--quick``: 6 x 256, vocabulary 8192, batch 8 x 128);
* ``llama32k``: a Llama with a 32000-token vocabulary (untied head) at seq 512, 4 x 256, 4 heads
  over 2, batch 2 x 512: the logits (and the loss's buffers of their size) are the step's peak
  (``--quick``: 2 x 128, batch 1 x 512, the same vocabulary).

Peers:

* ``plain``: the step as is.
* ``hf1`` / ``hf2``: ``model.gradient_checkpointing_enable()`` on every block / every second
  block (``gradient_checkpointing`` off on the others).
* ``cmp50`` / ``cmp25``: ``torch.compile(model)`` with ``torch._functorch.config.
  activation_memory_budget`` 0.5 / 0.25 (the min-cut partitioner's knapsack).
* ``hf1ob`` / ``hf1disk`` (not run unless named): ``hf1`` plus PyTorch's optimizer-in-backward
  recipe (one AdamW per parameter in ``register_post_accumulate_grad_hook``) / plus reentrant
  checkpointing with ``saved_tensors_hooks`` writing saved tensors of 1 MiB or more to files.

``ts.fit(model, opt, budget=...)`` with the budget a working set measured in the same run (round
1's, fixed for later rounds): ``ts-all`` at plain's (everything fits), ``ts-mid`` halfway
between plain's and hf1's, ``ts-hf1`` at hf1's, ``ts-0.6hf1`` at 0.6x hf1's, ``ts-cmp50`` /
``ts-cmp50h`` at cmp50's and half of it, ``ts-50p`` at half of plain's (on ``llama32k`` it should
choose the chunked LM loss: the notes under the table say whether it did, from ``explain()``
and ``outputs.logits is None``; its target is for ``llama32k`` only); ``tsc-cmp50`` /
``tsc-cmp50h`` the same with ``ts.fit(..., compile=True)`` (skipped, with a note, when ``ts.fit``
has no ``compile``). A variant the budgets need (plain, hf1, cmp50) is added when left out.

Every variant runs in fresh processes (this script with ``--worker``), two a round: one with
glibc's fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_=131072`` in its environment: freed
tensors' pages go back to the OS), whose peak is the **working set** (API §10's meaning of a
budget on the CPU), and one under the default allocator, whose peak is ``RSS`` and whose steps
give the **time**. Peak: the kernel's RSS high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` before the timed steps; a 2 ms psutil sampler where it cannot be
reset) above the process's RSS before the model was built (torch, transformers, tensorscope and,
for compiled variants, Inductor imported, the runtime warmed up). Per process: ``--warmup``
steps (a ts.fit runs more until its decision has settled: step 1 measures, step 2 re-times the
chain, step 3 is recorded, the next two are set against the prediction; a re-decision repeats
that; their times are printed apart), then ``--steps`` timed steps, their median. ``--rounds
N``: N rounds, each variant once per round, the order rotated after round 1; the table shows
the best (smallest) working set, RSS and time over the rounds; ``in budget``: the largest
working set seen <= 1.10 x budget + 32 MiB. ``losses``: every process's losses of the steps
plain ran against plain's: ``bits`` (identical), ``DIFF`` (not, where they should be: neither
compile nor the chunked loss in play) or the largest relative difference. ``x peer``: the time
against the peer the issue's target names; ``target``: the issue's table, met or missed;
``beaten by``: peers with no more working set and no more time. ``--clip``: every variant clips
the gradient norm before its optimizer step (HF Trainer's default).

    python benchmarks/fit_training.py --quick --rounds 1 --steps 2
    python benchmarks/fit_training.py --rounds 3 --pareto fit_pareto.png
    python benchmarks/fit_training.py --model llama32k --rounds 3 --variants plain,ts-50p --explain
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import _offload_common as common

MiB = common.MiB
FIXED_THRESHOLD = "131072"  # MALLOC_MMAP_THRESHOLD_ of the working-set processes
ALLOCATORS = ("fixed", "default")


@dataclass(frozen=True)
class Variant:
    """A ts.fit point: its budget (a sum of peers' working sets, weighted), whether fit compiles,
    the peer the issue compares its time with and the issue's target (step <= target x peer's)."""

    budget: tuple[tuple[str, float], ...]
    peer: str = "plain"
    target: float | None = None
    compile: bool = False
    models: tuple[str, ...] = ()  # the models the target is for (empty: all)


PEERS = ("plain", "hf1", "hf2", "cmp50", "cmp25", "hf1ob", "hf1disk")
DEFAULT_PEERS = PEERS[:5]
COMPILE_BUDGETS = {"cmp50": 0.5, "cmp25": 0.25}
FITS = {
    "ts-all": Variant((("plain", 1.0),), target=1.02),
    "ts-mid": Variant((("plain", 0.5), ("hf1", 0.5)), target=1.10),
    "ts-hf1": Variant((("hf1", 1.0),), peer="hf1", target=0.90),
    "ts-0.6hf1": Variant((("hf1", 0.6),), target=2.0),
    "ts-cmp50": Variant((("cmp50", 1.0),), peer="cmp50"),
    "ts-cmp50h": Variant((("cmp50", 0.5),), peer="cmp50"),
    "tsc-cmp50": Variant((("cmp50", 1.0),), peer="cmp50", target=1.00, compile=True),
    "tsc-cmp50h": Variant((("cmp50", 0.5),), peer="cmp50", target=1.25, compile=True),
    "ts-50p": Variant((("plain", 0.5),), target=1.15, models=("llama32k",)),
}
VARIANTS = DEFAULT_PEERS + tuple(FITS)


def _config(quick: bool, model: str) -> dict[str, Any]:
    def gpt2(layers: int, hidden: int, heads: int, vocab: int, batch: int, seq: int) -> Any:
        return {"model": "gpt2", "layers": layers, "hidden": hidden, "heads": heads,
                "vocab": vocab, "batch": batch, "seq": seq}  # fmt: skip

    def llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, tied: bool,
              batch: int, seq: int) -> Any:  # fmt: skip
        return {"model": "llama", "layers": layers, "hidden": hidden, "heads": heads,
                "kv_heads": kv, "ffn": ffn, "vocab": vocab, "tied": tied, "batch": batch,
                "seq": seq}  # fmt: skip

    shapes = {
        ("gpt2", False): gpt2(8, 256, 4, 4096, 8, 256),
        ("gpt2", True): gpt2(4, 128, 4, 4096, 4, 128),
        ("gpt2-124m", False): gpt2(12, 768, 12, 50257, 2, 256),
        ("gpt2-124m", True): gpt2(6, 256, 4, 8192, 8, 128),
        ("llama", False): llama(30, 576, 9, 3, 1536, 49152, True, 2, 256),
        ("llama", True): llama(6, 256, 4, 2, 688, 8192, True, 8, 128),
        ("llama32k", False): llama(4, 256, 4, 2, 688, 32000, False, 2, 512),
        ("llama32k", True): llama(2, 128, 4, 2, 344, 32000, False, 1, 512),
    }
    return {**shapes[(model, quick)], "name": model}


def _model(shape: dict[str, Any]) -> Any:
    import transformers as tf

    if shape["model"] == "llama":
        return tf.LlamaForCausalLM(
            tf.LlamaConfig(
                num_hidden_layers=shape["layers"],
                hidden_size=shape["hidden"],
                num_attention_heads=shape["heads"],
                num_key_value_heads=shape["kv_heads"],
                intermediate_size=shape["ffn"],
                vocab_size=shape["vocab"],
                max_position_embeddings=max(2048, shape["seq"]),
                tie_word_embeddings=shape["tied"],
                use_cache=False,
            )
        )
    return tf.GPT2LMHeadModel(
        tf.GPT2Config(
            n_layer=shape["layers"],
            n_embd=shape["hidden"],
            n_head=shape["heads"],
            vocab_size=shape["vocab"],
            n_positions=max(1024, shape["seq"]),
            use_cache=False,
        )
    )


# --------------------------------------------------------------------------- the peak
# NOTE [the peak from the kernel]
# Sampling RSS every 2 ms misses a peak shorter than that (a loss region's buffers can come and
# go faster); the kernel keeps the exact high-water mark (VmHWM), and writing "5" to
# /proc/self/clear_refs resets it to the current RSS (Linux >= 4.0). Where it cannot be reset the
# sampler stands in.


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _hwm() is not None


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


# --------------------------------------------------------------------------- the worker


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers  # imported before the baseline, as the others: not the variant's memory

    import tensorscope as ts

    variant, shape = cfg["variant"], cfg["shape"]
    fits = FITS.get(variant)
    compiled = variant in COMPILE_BUDGETS or (fits is not None and fits.compile)
    if compiled:
        import torch._dynamo
        import torch._inductor.compile_fx  # the compiler's own modules: not the variant's memory
    getattr(transformers, "LlamaForCausalLM" if shape["model"] == "llama" else "GPT2LMHeadModel")
    common.warm_up_runtime()
    common.settle_memory()
    base_rss = common.rss_bytes()
    torch.manual_seed(0)
    model = _model(shape).train()
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fit = None
    hooks: Any = contextlib.nullcontext()
    run: Any = model
    if variant.startswith("hf"):
        reentrant = {"use_reentrant": True} if variant == "hf1disk" else None
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reentrant)
        if variant == "hf2":
            blocks = getattr(model.base_model, "h", None) or model.base_model.layers
            for k, block in enumerate(blocks):
                block.gradient_checkpointing = k % 2 == 0
        if variant == "hf1ob":
            opt = _optimizer_in_backward(model)
        if variant == "hf1disk":
            hooks = _disk_hooks(model, cfg["tmp"])
    elif variant in COMPILE_BUDGETS:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = COMPILE_BUDGETS[variant]
        run = torch.compile(model)
    elif fits is not None:
        extra = {"compile": True} if fits.compile else {}
        fit = ts.fit(model, opt, budget=int(cfg["budget"]), **extra)
    g = torch.Generator().manual_seed(1)
    n_steps = cfg["warmup"] + cfg["steps"] + (8 if fit is not None else 0)
    batches = [
        torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
        for _ in range(n_steps)
    ]
    losses: list[float] = []
    logits_none: list[bool] = []

    def step(k: int) -> float:
        torch.manual_seed(k)
        start = time.perf_counter()
        with hooks:
            out = run(batches[k], labels=batches[k])
        # NOTE [only the loss kept]: holding the outputs would keep the logits alive
        logits_none.append(out.logits is None)
        loss = out.loss
        del out
        loss.backward()
        if cfg.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
        return time.perf_counter() - start

    def settled() -> bool:
        # NOTE [a settled decision]: once a step under it is recorded and its time set against
        # the prediction (which may decide again: the chain re-timed, a step recorded anew)
        return fit is None or (
            fit.plan_after is not None and bool(getattr(fit, "_timed_against", True))
        )

    warmup = [step(k) for k in range(cfg["warmup"])]
    while not settled() and len(warmup) < cfg["warmup"] + 8:
        warmup.append(step(len(warmup)))
    exact = _reset_hwm()
    sampler = contextlib.nullcontext() if exact else common.PeakSampler()
    with sampler:
        times = [step(k) for k in range(len(warmup), len(warmup) + cfg["steps"])]
    peak = _hwm() if exact else sampler.peak_rss  # type: ignore[union-attr]
    result: dict[str, Any] = {
        "variant": variant,
        "allocator": cfg["allocator"],
        "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "step_s": statistics.median(times),
        "warmup_s": warmup,
        "peak": (peak or 0) - base_rss,
        "peak_from": "VmHWM" if exact else "sampled",
        "losses": losses,
        "logits_none": all(logits_none[len(warmup) :]),
    }
    if fit is not None:
        if cfg.get("png_dir") and fit.plan_before and fit.plan_after:
            fit.plan_before.save_png(f"{cfg['png_dir']}/fit_{variant}_before.png", title="step 1")
            fit.plan_after.save_png(f"{cfg['png_dir']}/fit_{variant}_after.png", title="after")
        result["explain"] = fit.explain()
        result["chunked"] = "in row chunks" in result["explain"]
        result["budget"] = fit.budget_bytes
        fit.remove()
    return result


class _NoStep:
    """The loop's ``opt`` when updates run inside backward: ``step``, ``zero_grad`` do nothing."""

    def step(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass


def _optimizer_in_backward(model: Any) -> _NoStep:
    import torch

    per_param = {p: torch.optim.AdamW([p], lr=1e-4) for p in model.parameters()}

    def update(p: torch.Tensor) -> None:
        per_param[p].step()
        per_param[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(update)
    return _NoStep()


def _disk_hooks(model: Any, directory: str) -> Any:
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    names = itertools.count()

    def pack(t: torch.Tensor) -> Any:
        if t.nbytes < 2**20 or t.untyped_storage().data_ptr() in params:
            return t
        path = os.path.join(directory, f"{next(names)}.pt")
        torch.save(t, path)
        return path

    def unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, str):
            return packed  # type: ignore[no-any-return]
        t = torch.load(packed, weights_only=True)
        os.remove(packed)
        return t  # type: ignore[no-any-return]

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# --------------------------------------------------------------------------- the parent


def _run(cfg: dict[str, Any], allocator: str, timeout: float) -> common.WorkerRun:
    """One fresh process of ``cfg``'s variant under ``allocator`` (its environment)."""
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if allocator == "fixed":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = FIXED_THRESHOLD
    try:
        return common.run_worker(__file__, {**cfg, "allocator": allocator}, timeout)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def _chosen(text: str) -> list[str]:
    chosen = common.parse_variants(text, PEERS + tuple(FITS))
    if "tsc-cmp50" in chosen or "tsc-cmp50h" in chosen:
        import tensorscope as ts

        if "compile" not in inspect.signature(ts.fit).parameters:
            print("note: ts.fit has no compile= keyword here: tsc-cmp50, tsc-cmp50h skipped")
            chosen = [v for v in chosen if not v.startswith("tsc-")]
    needed = {peer for v in chosen if v in FITS for peer, _ in FITS[v].budget}
    needed |= {FITS[v].peer for v in chosen if v in FITS}
    added = [p for p in PEERS if p in needed and p not in chosen]
    if added:
        print(f"note: {', '.join(added)} added: the budgets or the comparisons need them")
    order = ["plain"] + [p for p in PEERS if p in chosen or p in added]  # peers first
    return list(dict.fromkeys(order + [v for v in chosen if v in FITS]))


def _budget(variant: str, ws: dict[str, float]) -> float | None:
    parts = FITS[variant].budget
    if any(peer not in ws for peer, _ in parts):
        return None
    return sum(ws[peer] * share for peer, share in parts)


def _loss_note(variant: str, runs: list[dict[str, Any]], ref: list[float]) -> str:
    worst = 0.0
    for r in runs:  # step k's batch and seed are the same in every process: the common steps
        for a, b in zip(r["losses"], ref, strict=False):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-30))
    if worst == 0.0:
        return "bits"
    exact = not (variant in COMPILE_BUDGETS or variant.startswith("tsc-"))
    exact = exact and not any(r.get("chunked") for r in runs)
    return f"DIFF {worst:.0e}" if exact else f"~{worst:.0e}"


def _table(results: dict[str, dict[str, Any]], model: str) -> tuple[list[Any], dict[str, Any]]:
    """The table's rows and, per variant, its numbers (for the notes and the plot)."""
    best = {
        v: {
            "ws": min(r["peak"] for r in rs["fixed"]),
            "ws_max": max(r["peak"] for r in rs["fixed"]),
            "rss": min(r["peak"] for r in rs["default"]),
            "step": min(r["step_s"] for r in rs["default"]),
        }
        for v, rs in results.items()
        if rs["fixed"] and rs["default"]
    }
    ref = results["plain"]["default"][0]["losses"] if "plain" in best else []
    rows: list[list[str]] = []
    for v, rs in results.items():
        if v not in best:
            error = str(rs.get("error", "no result"))
            rows.append([v, "error: " + error[:200]])
            continue
        b = best[v]
        fit = FITS.get(v)
        budget = rs["fixed"][0].get("budget")
        x_plain = b["step"] / best["plain"]["step"] if "plain" in best else float("nan")
        peer = fit.peer if fit else ""
        x_peer = b["step"] / best[peer]["step"] if peer in best else None
        within = ""
        if budget is not None:
            limit = 1.10 * budget + 32 * MiB
            within = "yes" if b["ws_max"] <= limit else f"NO (>{limit / MiB:.0f})"
        target = ""
        if fit and fit.target is not None and (not fit.models or model in fit.models):
            met = x_peer is not None and x_peer <= fit.target
            if fit.models == ("llama32k",):  # and the logits never whole
                met = met and all(r.get("chunked") and r["logits_none"] for r in rs["default"])
            verdict = "no peer" if x_peer is None else "met" if met else "missed"
            target = f"<={fit.target:.2f}x: {verdict}"
        beaten = [
            p
            for p in best
            if p in PEERS
            and fit
            and best[p]["ws"] <= b["ws"]
            and best[p]["step"] <= b["step"]
            and (best[p]["ws"], best[p]["step"]) != (b["ws"], b["step"])
        ]
        rows.append(
            [
                v,
                common.fmt_mib(budget),
                common.fmt_mib(b["ws"]),
                common.fmt_mib(b["rss"]),
                f"{b['step']:.3f}",
                f"{x_plain:.2f}x",
                f"{x_peer:.2f}x {peer}" if x_peer is not None else "",
                within,
                target,
                ",".join(beaten) if fit else "",
                _loss_note(v, rs["fixed"] + rs["default"], ref) if ref else "-",
            ]
        )
    return rows, best


def _pareto(best: dict[str, dict[str, float]], path: str) -> None:
    """Working set against step time (x plain): the peers (squares), ts.fit (circles: eager,
    triangles: compile=True)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for v, b in best.items():
        x, y = b["step"] / best["plain"]["step"], b["ws"] / MiB
        marker, color = ("s", "C1") if v in PEERS else ("^" if v.startswith("tsc-") else "o", "C0")
        ax.scatter([x], [y], marker=marker, color=color)
        ax.annotate(v, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("step time (x plain)")
    ax.set_ylabel("working set (MiB)")
    ax.set_title("ts.fit (circles; compile=True: triangles) vs the peers (squares)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="the model's small shape")
    parser.add_argument(
        "--model", choices=("gpt2", "gpt2-124m", "llama", "llama32k"), default="gpt2"
    )
    parser.add_argument("--warmup", type=int, default=4, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per variant and allocator")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {PEERS + tuple(FITS)}")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per process")
    parser.add_argument("--explain", action="store_true", help="print ts.fit's explain()")
    parser.add_argument("--png", default="", help="a directory for ts.fit's before/after plans")
    parser.add_argument("--pareto", default="", help="a PNG of working set vs step time")
    parser.add_argument(
        "--clip", action="store_true", help="clip_grad_norm_(1.0) before each optimizer step"
    )
    args = parser.parse_args()
    if args.worker:
        return common.worker_main(_worker, args.worker)
    variants = _chosen(args.variants)
    if args.clip and "hf1ob" in variants:
        parser.error("hf1ob updates inside backward: nothing can clip there (drop it or --clip)")
    shape = _config(args.quick, args.model)
    base = {"shape": shape, "warmup": max(3, args.warmup), "steps": max(1, args.steps)}
    base |= {"png_dir": args.png, "clip": args.clip}
    print(f"shape {shape}, warmup {base['warmup']}, steps {base['steps']}, rounds {args.rounds}")
    spill = tempfile.TemporaryDirectory(prefix="fit-bench-")
    results: dict[str, dict[str, Any]] = {v: {"fixed": [], "default": []} for v in variants}
    budgets: dict[str, float | None] = {}
    for r in range(max(1, args.rounds)):
        # NOTE [rounds]: a step's time moves by up to 40% from one process to the next on a
        # shared VM: each round runs every variant once (rotated after round 1: the budgets
        # are round 1's working sets, the same in every round)
        order = variants if r == 0 else common.round_orders(variants, args.rounds)[r]
        for v in order:
            if v in FITS and v not in budgets:
                ws = {p: rs["fixed"][0]["peak"] for p, rs in results.items() if rs["fixed"]}
                budgets[v] = _budget(v, ws)
            if v in FITS and budgets[v] is None:
                results[v]["error"] = "a peer its budget needs failed"
                continue
            cfg = {**base, "variant": v, "tmp": spill.name, "budget": budgets.get(v)}
            for alloc in ALLOCATORS if r % 2 == 0 else ALLOCATORS[::-1]:
                done = _run(cfg, alloc, args.timeout)
                if not done.ok:
                    results[v]["error"] = done.error
                    print(f"  round {r + 1} {v} {alloc}: ERROR {done.error}", file=sys.stderr)
                    continue
                results[v][alloc].append(done.result)
                print(
                    f"  round {r + 1} {v:<10} {alloc:<7}: peak +{done.result['peak'] / MiB:.0f} "
                    f"MiB, step {done.result['step_s']:.3f} s, process {done.wall_s:.0f} s",
                    file=sys.stderr,
                )
    rows, best = _table(results, args.model)
    print(
        f"\n{args.model}{' (quick)' if args.quick else ''}: best of {args.rounds} round(s); "
        f"working set: MALLOC_MMAP_THRESHOLD_={FIXED_THRESHOLD}; RSS and step: the default "
        f"allocator; in budget: largest working set <= 1.10 x budget + 32 MiB"
    )
    common.print_table(
        [
            ("variant", ""),
            ("budget", "MiB"),
            ("working set", "MiB"),
            ("RSS", "MiB"),
            ("step", "s"),
            ("x plain", ""),
            ("x peer", ""),
            ("in budget", ""),
            ("target", "(issue 27)"),
            ("beaten by", "(peers)"),
            ("losses", "vs plain"),
        ],
        rows,
    )
    for v, rs in results.items():
        runs = rs["default"]
        if v in FITS and runs:
            steps = " ".join(f"{t:.2f}" for t in runs[0]["warmup_s"])
            loss = "chunked (the logits never whole)" if runs[0].get("chunked") else "whole"
            print(
                f"{v}: warm-up steps {steps} s (step 1 measures, 2 re-times, 3 is recorded); "
                f"LM loss {loss}; outputs.logits None: {runs[0]['logits_none']}"
            )
    if args.pareto and "plain" in best:
        _pareto(best, args.pareto)
    if args.explain:
        for v, rs in results.items():
            if rs["default"] and "explain" in rs["default"][0]:
                print(f"\n{v} (round 1, default allocator):\n{rs['default'][0]['explain']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
