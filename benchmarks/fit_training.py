"""``ts.fit`` against plain training and its peers (issue 17's table).

Model: transformers GPT-2 built from a config with random weights (default: the 124M shape,
12 x 768, 12 heads, 50257-token vocabulary, batch 2 x 256; ``--quick``: 6 x 256, 4 heads, an
8192-token vocabulary, batch 8 x 128) or, with ``--model llama``, a Llama of SmolLM-135M's shape
(30 x 576, 9 heads over 3 key/value heads, tied 49152-token vocabulary, batch 2 x 256;
``--quick``: 6 x 256, vocabulary 8192, batch 8 x 128), fp32, dropout on, no KV cache,
``torch.optim.AdamW``, ``loss = model(ids, labels=ids).loss``; the user's loop: forward,
backward, ``opt.step()``, ``opt.zero_grad()``.

Variants, each in a fresh process (this script with ``--worker``):

* ``plain``: the step as is.
* ``hf1``: ``model.gradient_checkpointing_enable()`` (every block recomputed once).
* ``hf2``: the same on every second block (``gradient_checkpointing`` off on the others).
* ``hf1ob``: ``hf1`` plus optimizer-in-backward as PyTorch's tutorial writes it (one AdamW per
  parameter, stepped in ``register_post_accumulate_grad_hook``; the loop calls no ``opt.step()``).
* ``hf1disk``: ``hf1`` (reentrant, so that each block's input is a saved tensor) plus
  ``saved_tensors_hooks`` that write every saved tensor of 1 MiB or more that is not a parameter
  to a file (``torch.save``/``torch.load``, as PyTorch's autograd-hooks tutorial does).
* ``cmp50`` / ``cmp25``: ``torch.compile(model)`` with ``torch._functorch.config.
  activation_memory_budget`` 0.5 / 0.25 (the min-cut partitioner's knapsack; compiling happens in
  the warm-up steps, losses differ from eager's in the last bits).
* ``ts60`` / ``ts40`` / ``ts30`` / ``ts25``: ``ts.fit(model, opt, budget=...)`` at 60% / 40% /
  30% / 25% of plain's step memory (the peak of its tensors, parameters and AdamW's state
  included, as ``ts.record`` counts it; plain's worker measures it first).
* ``tshf1``: ``ts.fit`` with the budget at ``hf1``'s tensor peak (same memory: is it faster?).
* ``tscompile`` / ``tscompileh``: ``ts.fit(..., compile=True)`` with the budget at ``cmp50``'s
  tensor peak / half of it (needs ``cmp50`` in the same run); two more warm-up steps (step 2
  compiles, step 3 re-times the chain, step 4 is recorded); losses allclose, not plain's bits.
* ``ts60r`` / ``ts40r`` / ``ts30r``: the same budgets with activation offload taken out of
  ts.fit's choices (an ablation: every block kept or recomputed, as before offload was a
  choice), to show what offloading buys at that budget; ``ts60o`` / ``ts40o`` / ``ts30o``: the
  other way, offload predicted to take no time, so every block that fits is offloaded (what
  offloading really costs, against the whole-I/O count the decision uses).

Per variant: ``--warmup`` steps (ts.fit: step 1 measures, step 2 re-times, step 3 is recorded),
then ``--steps`` timed steps: the median seconds per step and its ratio to plain's (with
``--rounds N``, every variant runs N times in turn and ``step`` is the median of the N); ``peak
RSS``: the process's resident memory sampled every 2 ms (psutil) during the timed steps, above
its RSS before the model was built; ``tensors``: a recorded step's tensor peak (ts.record; for
ts.fit, ``fit.measured_peak(fit.plan_after)``: the recorded step's peak with what an offloader
held read back ahead of use added, and the chain's parameters, where they are in files, counted
as mapped in); the losses of every step, compared with plain's bit for bit.
``--clip``: every variant clips the gradient norm before its optimizer step, as HF's Trainer
does by default (gradients must then all exist at once: no optimizer-in-backward).

    python benchmarks/fit_training.py --quick
    python benchmarks/fit_training.py --model llama --steps 1
    python benchmarks/fit_training.py --steps 1 --clip --variants plain,hf1,ts60,ts40 --explain
    python benchmarks/fit_training.py --quick --variants plain,cmp50,tscompile,tscompileh
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import _offload_common as common

VARIANTS = (
    "plain",
    "hf1",
    "hf2",
    "hf1ob",
    "hf1disk",
    "cmp50",
    "cmp25",
    "ts60",
    "tshf1",
    "tscompile",
    "tscompileh",
    "ts40",
    "ts30",
    "ts25",
    "ts60r",
    "ts40r",
    "ts30r",
    "ts60o",
    "ts40o",
    "ts30o",
)
PEERS = ("plain", "hf1", "hf2", "hf1ob", "hf1disk", "cmp50", "cmp25")
COMPILE_BUDGETS = {"cmp50": 0.5, "cmp25": 0.25}
BUDGETS = {"ts60": 0.6, "ts40": 0.4, "ts30": 0.3, "ts25": 0.25}


def _config(quick: bool, model: str) -> dict[str, Any]:
    if model == "llama":
        # SmolLM-135M's shape: 30 x 576, 9 heads over 3 key/value heads, tied 49152-token vocabulary
        if quick:
            return {"model": model, "layers": 6, "hidden": 256, "heads": 4, "kv_heads": 2,
                    "ffn": 688, "vocab": 8192, "batch": 8, "seq": 128}  # fmt: skip
        return {"model": model, "layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3,
                "ffn": 1536, "vocab": 49152, "batch": 2, "seq": 256}  # fmt: skip
    if quick:
        return {"model": model, "layers": 6, "hidden": 256, "heads": 4, "vocab": 8192,
                "batch": 8, "seq": 128}  # fmt: skip
    return {"model": model, "layers": 12, "hidden": 768, "heads": 12, "vocab": 50257,
            "batch": 2, "seq": 256}  # fmt: skip


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
                tie_word_embeddings=True,
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


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tensorscope as ts

    common.warm_up_runtime()
    common.settle_memory()
    base_rss = common.rss_bytes()
    torch.manual_seed(0)
    shape = cfg["shape"]
    model = _model(shape).train()
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
    variant = cfg["variant"]
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
    elif variant in BUDGETS or variant[:-1] in BUDGETS:
        if variant.endswith("o"):  # the other ablation: offload predicted free
            _offload_for_free()
        share = BUDGETS[variant if variant in BUDGETS else variant[:-1]]
        fit = ts.fit(model, opt, budget=int(cfg["plain_tensors"] * share))
        if variant.endswith("r"):  # the ablation: no block offloaded
            fit._offload.off = "taken out of the choices (the benchmark's ablation)"
    elif variant == "tshf1":
        if cfg.get("hf1_tensors") is None:
            raise SystemExit("tshf1 needs hf1 in the same run (--variants ...,hf1,tshf1)")
        fit = ts.fit(model, opt, budget=int(cfg["hf1_tensors"]))
    elif variant.startswith("tscompile"):
        if cfg.get("cmp50_tensors") is None:
            raise SystemExit(f"{variant} needs cmp50 in the same run (--variants ...,cmp50,...)")
        share = 0.5 if variant == "tscompileh" else 1.0
        fit = ts.fit(model, opt, budget=int(cfg["cmp50_tensors"] * share), compile=True)
        cfg = {**cfg, "warmup": cfg["warmup"] + 2}  # compiles, re-times, then is recorded
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
        for _ in range(cfg["warmup"] + cfg["steps"])
    ]
    losses: list[float] = []

    def step(ids: torch.Tensor, k: int) -> None:
        torch.manual_seed(k)
        with hooks:
            loss = run(ids, labels=ids).loss
        loss.backward()
        if cfg.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))

    tensors = None
    for k in range(cfg["warmup"]):
        if variant in PEERS and k == cfg["warmup"] - 1:
            with ts.record() as rec:
                step(batches[k], k)
            tensors = rec.plan().peak_bytes
        else:
            step(batches[k], k)
    if fit is not None and fit.plan_after is not None:
        tensors = fit.measured_peak(fit.plan_after)
    sampler = common.PeakSampler()
    times = []
    for k in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        with sampler:
            start = time.perf_counter()
            step(batches[k], k)
            times.append(time.perf_counter() - start)
    result = {
        "variant": variant,
        "step_s": statistics.median(times),
        "peak_rss": sampler.peak_rss - base_rss,
        "tensors": tensors,
        "losses": losses,
    }
    if fit is not None and cfg.get("png_dir") and fit.plan_before and fit.plan_after:
        fit.plan_before.save_png(f"{cfg['png_dir']}/fit_{variant}_before.png", title="step 1")
        fit.plan_after.save_png(f"{cfg['png_dir']}/fit_{variant}_after.png", title="step 3")
    if fit is not None:
        result["explain"] = fit.explain()
        result["budget"] = fit.budget_bytes
        fit.remove()
    return result


class _NoStep:
    """The loop's ``opt`` when updates run inside backward: ``step``, ``zero_grad`` do nothing."""

    def step(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass


def _offload_for_free() -> None:
    """``ts*o``: ts.fit's offload model with no I/O time, so every block it can offload is
    offloaded (what the offload really costs, against the count the decision uses)."""
    from tensorscope.checkpoint.offloaded import OffloadModel
    from tensorscope.fit.decider import Decider

    measured = Decider.offload_model

    def free(self: Decider) -> OffloadModel | None:
        model = measured(self)
        return None if model is None else OffloadModel(model.nbytes, (0.0,) * len(model.nbytes))

    Decider.offload_model = free  # type: ignore[method-assign]


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


def _pareto(results: dict[str, dict[str, Any]], path: str) -> None:
    """Tensor peak against step time (x plain) per variant: tensorscope's points and the peers'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain_s = results["plain"]["step_s"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for variant, r in results.items():
        if "error" in r or r.get("tensors") is None:
            continue
        ours = variant.startswith("ts")
        x, y = r["step_s"] / plain_s, r["tensors"] / 2**20
        ax.scatter([x], [y], marker="o" if ours else "s", color="C0" if ours else "C1")
        ax.annotate(variant, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("step time (x plain)")
    ax.set_ylabel("tensor peak (MiB)")
    ax.set_title("ts.fit (circles) vs plain and the peers (squares)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _same_losses(losses: list[float], plain: list[float]) -> str:
    """``yes``: plain's bits; ``allclose``: within rtol 1e-5 (compiled kernels) over the steps
    both ran; ``NO`` otherwise."""
    if losses == plain:
        return "yes"
    both = list(zip(losses, plain, strict=False))
    return "allclose" if all(abs(a - b) <= 1e-5 * abs(b) for a, b in both) else "NO"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="the small shape")
    parser.add_argument(
        "--model", choices=("gpt2", "llama"), default="gpt2", help="llama: SmolLM-135M's shape"
    )
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--explain", action="store_true", help="print ts.fit's explain()")
    parser.add_argument("--png", default="", help="a directory for ts.fit's before/after plans")
    parser.add_argument("--pareto", default="", help="a PNG of tensor peak vs step time")
    parser.add_argument(
        "--clip",
        action="store_true",
        help="clip_grad_norm_(1.0) before each optimizer step (HF Trainer's default): gradients "
        "must all exist at once",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every variant this many times, in turn; step: the median over the rounds",
    )
    args = parser.parse_args()
    if args.worker:
        return common.worker_main(_worker, args.worker)
    variants = common.parse_variants(args.variants, VARIANTS)
    if args.clip and "hf1ob" in variants:
        parser.error("hf1ob updates inside backward: nothing can clip there (drop it or --clip)")
    base = {
        "shape": _config(args.quick, args.model),
        "warmup": max(4, args.warmup),
        "steps": args.steps,
        "png_dir": args.png,
        "clip": args.clip,
    }
    print(
        f"shape {base['shape']}, warmup {base['warmup']}, steps {base['steps']}"
        + (", clip_grad_norm_(1.0) every step" if args.clip else "")
    )
    results: dict[str, dict[str, Any]] = {}
    spill = tempfile.TemporaryDirectory(prefix="fit-bench-")
    base["tmp"] = spill.name
    plain = common.run_worker(__file__, {**base, "variant": "plain"}, args.timeout)
    if not plain.ok:
        print(f"plain failed: {plain.error}")
        return 1
    results["plain"] = plain.result
    times: dict[str, list[float]] = {"plain": [plain.result["step_s"]]}
    for round_ in range(max(1, args.rounds)):
        # NOTE: one process's step time moved by up to 40% from one run to the next on this
        # machine (a shared VM); rounds in turn let each variant meet the same slow spells
        for variant in variants:
            if variant == "plain" and round_ == 0:
                continue
            cfg = {
                **base,
                "variant": variant,
                "plain_tensors": plain.result["tensors"],
                "hf1_tensors": results.get("hf1", {}).get("tensors"),
                "cmp50_tensors": results.get("cmp50", {}).get("tensors"),
            }
            run = common.run_worker(__file__, cfg, args.timeout)
            if round_ == 0:
                results[variant] = (
                    run.result if run.ok else {"variant": variant, "error": run.error}
                )
            if run.ok:
                times.setdefault(variant, []).append(run.result["step_s"])
    for variant, seen in times.items():
        results[variant]["step_s"] = statistics.median(seen)
    ref = results["plain"]
    rows = []
    for variant in variants:
        r = results.get(variant, {})
        if "error" in r:
            rows.append([variant, "error: " + str(r["error"])[:200]])
            continue
        same = _same_losses(r["losses"], ref["losses"])
        budget = common.fmt_mib(r["budget"]) if "budget" in r else ""
        rows.append(
            [
                variant,
                budget,
                common.fmt_mib(r["tensors"]),
                common.fmt_mib(r["peak_rss"]),
                f"{r['step_s']:.3f} s ({r['step_s'] / ref['step_s']:.2f}x)",
                same,
            ]
        )
    common.print_table(
        [
            ("variant", ""),
            ("budget", "MiB"),
            ("tensors", "MiB"),
            ("peak RSS", "MiB"),
            ("step", "s (x plain)"),
            ("losses", "= plain"),
        ],
        rows,
    )
    if args.pareto:
        _pareto(results, args.pareto)
    if args.explain:
        for variant in variants:
            if "explain" in results.get(variant, {}):
                print(f"\n{variant}:\n{results[variant]['explain']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
