"""Step time with ``ts.scope()`` vs plain PyTorch, and µs added per op.

Workloads: (a) MLP 784-1024-1024-10, batch 64, Adam; (b)
``nn.TransformerEncoderLayer(d_model=512, nhead=8, batch_first=True)`` on (8, 256, 512), Adam;
(c) a 64-element add of two refs, in a tight loop; (d) HF ``generate()`` (greedy, 8 new tokens,
KV cache) of tiny GPT-2 and Llama models built from configs (4 layers, hidden 256), whose
thousands of small ops are what LLM decoding looks like, with the cost per tensor the scope
creates (the scope's extra time over the number of tensors it owned).

Method: both variants train the same model in one process. Steps alternate plain/scoped (the
order flips every round) so drift in CPU frequency, caches and the allocator hits both sides
alike; each round's ratio is median(scoped) / median(plain) over its steps, and the reported
ratio is the median over rounds.

Batches cycle through a small pool of random data; denormals are flushed to zero.

Run: ``python benchmarks/scope_overhead.py`` (``--quick`` for a short smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import tensorscope as ts


def _mlp_step() -> Callable[[], None]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    opt = torch.optim.Adam(model.parameters())
    batches = [(torch.randn(64, 784), torch.randint(0, 10, (64,))) for _ in range(16)]
    count = [0]

    def step() -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def _transformer_step() -> Callable[[], None]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=512, nhead=8, batch_first=True)
    opt = torch.optim.Adam(layer.parameters())
    batches = [torch.randn(8, 256, 512) for _ in range(4)]
    count = [0]

    def step() -> None:
        x = batches[count[0] % len(batches)]
        count[0] += 1
        loss = layer(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def _timed(step: Callable[[], None], scoped: bool) -> float:
    context = ts.scope() if scoped else contextlib.nullcontext()
    start = time.perf_counter()
    with context:
        step()
    return time.perf_counter() - start


def step_ratio(step: Callable[[], None], rounds: int, steps: int) -> tuple[float, float, float]:
    """(median plain s, median scoped s, median over rounds of the per-round ratio)."""
    for _ in range(3):
        _timed(step, False)
        _timed(step, True)
    plain_all: list[float] = []
    scoped_all: list[float] = []
    ratios: list[float] = []
    for round_index in range(rounds):
        plain: list[float] = []
        scoped: list[float] = []
        for i in range(steps):
            first_scoped = (round_index + i) % 2 == 1
            for scoped_now in (first_scoped, not first_scoped):
                (scoped if scoped_now else plain).append(_timed(step, scoped_now))
        ratios.append(statistics.median(scoped) / statistics.median(plain))
        plain_all += plain
        scoped_all += scoped
    return statistics.median(plain_all), statistics.median(scoped_all), statistics.median(ratios)


def per_op_added_us(repeats: int, n: int) -> tuple[float, float]:
    """(plain µs per add, µs added per add inside a scope), medians of interleaved loops."""
    a = ts.ref(torch.randn(64))
    b = ts.ref(torch.randn(64))

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(n):
            a + b
        return (time.perf_counter() - start) / n * 1e6

    plain, added = [], []
    for _ in range(repeats):
        base = loop()
        with ts.scope():
            inside = loop()
        plain.append(base)
        added.append(inside - base)
    return statistics.median(plain), statistics.median(added)


def _generate_step(kind: str) -> tuple[Callable[[], None], Callable[[], int]]:
    """A generate() call of a tiny model, and a count of the tensors one call creates."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=1000, n_positions=128, n_embd=256, n_layer=4, n_head=4
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=1000,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 1000, (1, 16))
    mask = torch.ones_like(ids)

    def step() -> None:
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
            )

    def created() -> int:
        before = ts.stats().created_in_scope
        with ts.scope():
            step()
        return ts.stats().created_in_scope - before

    return step, created


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (smoke test)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-generate", action="store_true", help="skip the generate() rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Long runs on random data drive Adam's moments into denormals, which slow CPU kernels
    # tenfold and swamp what is measured here.
    torch.set_flush_denormal(True)
    rounds, mlp_steps, tf_steps, op_repeats, gen_steps = (
        (2, 5, 2, 3, 3) if args.quick else (9, 15, 5, 15, 7)
    )

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'workload':<44}{'plain':>10}{'scoped':>10}{'ratio':>8}{'target':>8}")
    for name, make, steps, target in (
        ("MLP 784-1024-1024-10, b64, Adam", _mlp_step, mlp_steps, 1.10),
        ("TransformerEncoderLayer 512/8 on (8,256,512)", _transformer_step, tf_steps, 1.05),
    ):
        plain, scoped, ratio = step_ratio(make(), rounds, steps)
        print(f"{name:<44}{plain * 1e3:>8.2f}ms{scoped * 1e3:>8.2f}ms{ratio:>8.3f}{target:>7.2f}x")
    plain_us, added_us = per_op_added_us(op_repeats, 20000)
    print(
        f"{'64-element add of refs (µs per op)':<44}{plain_us:>8.2f}us"
        f"{plain_us + added_us:>8.2f}us{'+' + format(added_us, '.2f'):>8}{'+5.00':>8}"
    )
    if args.no_generate:
        return
    for kind in ("gpt2", "llama"):
        step, created = _generate_step(kind)
        plain, scoped, ratio = step_ratio(step, rounds, gen_steps)
        name = f"{kind} generate(), 4x256, 8 new tokens"
        print(f"{name:<44}{plain * 1e3:>8.2f}ms{scoped * 1e3:>8.2f}ms{ratio:>8.3f}{1.35:>7.2f}x")
        count = created()
        per_tensor = (scoped - plain) / count * 1e6
        label = f"  per tensor it creates ({count} tensors)"
        print(f"{label:<44}{'':>10}{'':>10}{'+' + format(per_tensor, '.2f'):>8}{'+2.00':>8}")


if __name__ == "__main__":
    main()
