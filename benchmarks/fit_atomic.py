"""What ``ts.fit(..., atomic=True)`` costs (docs/fit.md, "Aborted steps").

An atomic step keeps gradients until ``optimizer.step()`` and runs that step whole (no update
inside backward, no kept-gradient step run one parameter at a time): an exception out of the
step then leaves parameters and optimizer state as they were. Measured here, in one process,
side by side (the same model, data and seeds; default and atomic fits in turn):

* ``least``: the smallest budget any plan fits (``decision.least_budget``);
* at each budget (a share of plain's tensor peak): the chosen plan's predicted peak, the
  measured peak (``fit.measured_peak(fit.plan_after)``) and the median step time;
* the alternatives not built: an undo copy of each updated parameter and its optimizer state,
  held until backward has finished (what it would add to the step's peak: those bytes, at the
  end of backward), and the time of making such a copy of every parameter and its AdamW state
  once (what it would add to every step).

Model: the quick shape of ``fit_training.py`` (GPT-2 6 x 256, 4 heads, 8192-token vocabulary,
batch 8 x 128, AdamW), or ``--tiny`` (GPT-2 4 x 32, 97 words, batch 4 x 32, for a smoke run).

    python benchmarks/fit_atomic.py --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any


def _model(tiny: bool) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    shape = (4, 32, 4, 97) if tiny else (6, 256, 4, 8192)
    cfg = tf.GPT2Config(
        n_layer=shape[0], n_embd=shape[1], n_head=shape[2], vocab_size=shape[3], use_cache=False
    )
    return tf.GPT2LMHeadModel(cfg).train()


def _data(tiny: bool, n: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    batch, seq, vocab = (4, 32, 97) if tiny else (8, 128, 8192)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


def _step(model: Any, opt: Any, ids: Any, k: int) -> float:
    import torch

    torch.manual_seed(k)
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def _plain_peak(tiny: bool) -> int:
    import torch

    import tensorscope as ts

    model = _model(tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = _data(tiny, 2)
    _step(model, opt, data[0], 0)
    with ts.record() as rec:
        _step(model, opt, data[1], 1)
    return rec.plan().peak_bytes


def _fitted(tiny: bool, budget: int, atomic: bool, steps: int) -> dict[str, Any]:
    import torch

    import tensorscope as ts
    from tensorscope.errors import ScheduleError

    model = _model(tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fit = ts.fit(model, opt, budget=budget, atomic=atomic)
    data = _data(tiny, 3 + steps)
    times = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k, ids in enumerate(data):
                elapsed = _step(model, opt, ids, k)
                if k >= 3:
                    times.append(elapsed)
    except ScheduleError as exc:
        least = int(str(exc).split("fits is ")[1].split("(")[1].split(" ")[0])
        return {"fits": False, "least": least}
    finally:
        fit.remove()
    decision = fit.decision
    assert decision is not None and fit.plan_after is not None
    return {
        "fits": True,
        "least": decision.least_budget,
        "free_gradients": decision.free_gradients,
        "predicted": decision.chosen.predicted_peak,
        "measured": fit.measured_peak(fit.plan_after),
        "step_s": statistics.median(times),
    }


def _undo_copy(tiny: bool, repeats: int = 5) -> tuple[int, float]:
    """Bytes of every parameter and its AdamW state, and the median seconds to copy them."""
    import torch

    model = _model(tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, opt, _data(tiny, 1)[0], 0)
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    nbytes = sum(t.nbytes for t in tensors)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        copies = [t.clone() for t in tensors]
        seconds.append(time.perf_counter() - start)
        del copies
    return nbytes, statistics.median(seconds)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run on a tiny GPT-2")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--shares", default="1.0,0.6,0.4", help="budgets, shares of plain's")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    plain = _plain_peak(args.tiny)
    print(f"plain tensor peak: {_mib(plain)}")
    for share in (float(s) for s in args.shares.split(",")):
        budget = int(plain * share)
        for atomic in (False, True):
            r = _fitted(args.tiny, budget, atomic, args.steps)
            name = f"{share:.0%} {'atomic ' if atomic else 'default'}"
            if not r["fits"]:
                print(f"{name}: no plan fits; least budget {_mib(r['least'])}")
                continue
            grads = "freed in backward" if r["free_gradients"] else "kept"
            print(
                f"{name}: least {_mib(r['least'])}, gradients {grads}, predicted "
                f"{_mib(r['predicted'])}, measured {_mib(r['measured'])}, step "
                f"{r['step_s'] * 1e3:.0f} ms"
            )
    nbytes, seconds = _undo_copy(args.tiny)
    print(
        f"undo copy (every parameter and its AdamW state): {_mib(nbytes)} held until backward "
        f"ends, {seconds * 1e3:.1f} ms to make it"
    )


if __name__ == "__main__":
    main()
