"""Spike benchmark: per-op cost of the interception options below the Python-mode floor.

Variants (all in one process, interleaved; results and decision: docs/design.md §9):
  plain         no interception
  pymode        an empty Python TorchDispatchMode (``func._op``, ``_should_skip_dynamo`` False)
  ts.scope      today's ``ts.scope()``
  pyfallback    (c) a Python boxed fallback (``torch.library.Library("_", "IMPL").fallback``) on a
                spare key in the TLS included set; it only redispatches
  cpp.pass      the C++ fallback on its key, redispatch only (floor of the C++ design)
  cpp.a         (a) C++ records a weak_intrusive_ptr per fresh result; no GIL per op
  cpp.b         (b) (a) + GIL + THPVariable_Wrap + type switch to TensorRef per fresh result
  cpp.b+site    (b) + creation site (first user frame) captured in C
  cpp.cb        C++ key, then today's Python ``adopt`` (class switch, RefState, site) called
                per fresh result (GIL + a Python call per tensor)

Every variant opens and closes its scope per timed call, and disposes the survivors at exit
(C++ variants: the alive entries come back to Python, their class is switched to
DisposedTensor and their TensorImpl emptied, as tensorscope does).

Run: ``.venv/bin/python docs/spikes/hotpath/bench.py [--quick] [--key KEY] [--no-generate]``

``ts.scope`` is the pure-Python engine of tensorscope as committed at HEAD (extracted with
``git archive`` into /tmp/hotpath_ts_head, so that work in progress in the checkout does not move
the baseline); ``--ts tree`` uses the checkout's tensorscope instead (``TENSORSCOPE_ENGINE`` is
left as set in the environment).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _pick_tensorscope() -> str:
    which = "head"
    if "--ts" in sys.argv:
        which = sys.argv[sys.argv.index("--ts") + 1]
    if which == "head":
        import subprocess

        root = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=HERE, text=True).strip()
        rev = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True).strip()
        dest = f"/tmp/hotpath_ts_head/{rev[:12]}"
        if not os.path.isdir(os.path.join(dest, "tensorscope")):
            os.makedirs(dest, exist_ok=True)
            archive = subprocess.Popen(["git", "archive", rev, "tensorscope"], cwd=root, stdout=subprocess.PIPE)
            subprocess.check_call(["tar", "-x", "-C", dest], stdin=archive.stdout)
            archive.wait()
        sys.path.insert(0, dest)
        return f"HEAD {rev[:12]} (pure Python)"
    return "checkout"


TS_SOURCE = _pick_tensorscope()

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import _ext  # noqa: E402
import tensorscope as ts  # noqa: E402
from tensorscope import _intercept, _sites  # noqa: E402
from tensorscope._state import Counters, Owner  # noqa: E402
from tensorscope.ref import DisposedTensor, TensorRef, _release_all  # noqa: E402

KEY_VALUES = {"DeferredInit": 40, "TESTING_ONLY_GenericWrapper": 43, "TESTING_ONLY_GenericMode": 44}


# ------------------------------------------------------------------------------ variants
class EmptyMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func._op(*args, **kwargs) if kwargs else func._op(*args)


class CountingMode(TorchDispatchMode):
    """Counts the ops the Python key sees (after Autograd and CompositeImplicit decompositions)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func._op(*args, **kwargs) if kwargs else func._op(*args)


def _dispose(tensors: list[torch.Tensor]) -> None:
    batch = []
    for t in tensors:
        if type(t) is not DisposedTensor:
            t.__class__ = DisposedTensor
            batch.append(t)
    _release_all(batch)


class Spike:
    """The C++ extension, installed on ``key``, plus a Python fallback on ``py_key``."""

    def __init__(self, key: str) -> None:
        self.ext = _ext.load()
        self.key = key
        if not self.ext.install(key):
            raise SystemExit(f"{key} already has a backend fallback")
        free = [k for k in KEY_VALUES if k != key and not self.ext.has_fallback(k)]
        if not free:
            raise SystemExit("no free key for the Python fallback")
        self.py_key = free[0]
        self.py_dk = torch._C.DispatchKey(KEY_VALUES[self.py_key])
        self._py_lib = torch.library.Library("_", "IMPL")
        exclude = torch._C.DispatchKeySet(self.py_dk)
        guard = torch._C._ExcludeDispatchKeyGuard

        def py_fallback(op, *args, **kwargs):  # type: ignore[no-untyped-def]
            with guard(exclude):
                return op(*args, **kwargs)

        self._py_lib.fallback(py_fallback, self.py_key)
        self.owner = Owner()
        self.owner.name = "spike"
        self.counters = Counters()

    def variants(self) -> dict[str, Callable[[], contextlib.AbstractContextManager[None]]]:
        return {
            "plain": contextlib.nullcontext,
            "pymode": EmptyMode,
            "ts.scope": ts.scope,
            "pyfallback": self.py_fallback_scope,
            "cpp.pass": lambda: self.cpp_scope(0),
            "cpp.a": lambda: self.cpp_scope(1),
            "cpp.b": lambda: self.cpp_scope(2),
            "cpp.b+site": lambda: self.cpp_scope(3),
            "cpp.cb": lambda: self.cpp_scope(4),
        }

    @contextlib.contextmanager
    def py_fallback_scope(self) -> Iterator[None]:
        torch._C._dispatch_tls_set_dispatch_key_included(self.py_dk, True)
        try:
            yield
        finally:
            torch._C._dispatch_tls_set_dispatch_key_included(self.py_dk, False)

    @contextlib.contextmanager
    def cpp_scope(self, mode: int) -> Iterator[None]:
        ext = self.ext
        if mode == 4:
            owner, counters, adopt = self.owner, self.counters, _intercept.adopt
            ext.configure(4, TensorRef, callback=lambda t: adopt(t, owner, counters))
        else:
            ext.configure(mode, TensorRef, _sites._verdicts, _sites._classify)
        ext.push()
        try:
            yield
        finally:
            alive, _recorded, _freed = ext.pop()
            if mode == 4:
                alive = [s() for s in self.owner.owned_states()]
                alive = [t for t in alive if t is not None]
                self.owner._owned.clear()
            _dispose(alive)


# ------------------------------------------------------------------------------ workloads
def make_generate(kind: str) -> Callable[[], None]:
    import transformers

    transformers.logging.set_verbosity_error()
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

    return step


# Timings are the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID) by default: the machine is
# shared (2 cores, other people's test runs), and a thread that is preempted stops its CPU clock,
# so preemption does not land in one variant's sample. Everything measured runs on this one
# thread (torch.set_num_threads(1)). ``--clock wall`` uses perf_counter instead.
CLOCK = time.thread_time


def timed(variant: Callable[[], contextlib.AbstractContextManager[None]], fn: Callable[[], None]) -> float:
    clock = CLOCK
    start = clock()
    with variant():
        fn()
    return clock() - start


def compare(
    variants: dict[str, Callable[[], contextlib.AbstractContextManager[None]]],
    fn: Callable[[], None],
    rounds: int,
    steps: int,
) -> dict[str, tuple[float, float, float, float]]:
    """name -> (median s, median of per-round ratios vs plain, min ratio, max ratio)."""
    names = list(variants)
    for _ in range(2):
        for name in names:
            timed(variants[name], fn)
    samples: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        if r % 2:
            order.reverse()
        per_round: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(steps):
            for name in order:
                per_round[name].append(timed(variants[name], fn))
        base = statistics.median(per_round["plain"])
        for name in names:
            ratios[name].append(statistics.median(per_round[name]) / base)
            samples[name] += per_round[name]
    return {
        n: (statistics.median(samples[n]), statistics.median(ratios[n]), min(ratios[n]), max(ratios[n]))
        for n in names
    }


def per_op(
    variants: dict[str, Callable[[], contextlib.AbstractContextManager[None]]],
    repeats: int,
    n: int,
) -> dict[str, tuple[float, float, float]]:
    """name -> (median µs per 64-element add, median µs added vs plain, IQR of the added)."""
    a = torch.randn(64)
    b = torch.randn(64)

    def loop() -> None:
        for _ in range(n):
            a + b

    names = list(variants)
    us: dict[str, list[float]] = {k: [] for k in names}
    added: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        this: dict[str, float] = {}
        for name in order:
            this[name] = timed(variants[name], loop) / n * 1e6
        for name in names:
            us[name].append(this[name])
            added[name].append(this[name] - this["plain"])
    out = {}
    for name in names:
        q = statistics.quantiles(added[name], n=4) if len(added[name]) >= 4 else [0, 0, 0]
        out[name] = (statistics.median(us[name]), statistics.median(added[name]), q[2] - q[0])
    return out


def count_ops(spike: Spike, fn: Callable[[], None]) -> dict[str, int]:
    counting = CountingMode()
    with counting:
        fn()
    ext = spike.ext
    ext.configure(1)
    ext.reset_counters()
    ext.push()
    fn()
    c = ext.counters()
    alive, recorded, freed = ext.pop()
    _dispose(alive)
    before = ts.stats().created_in_scope
    with ts.scope():
        fn()
    created = ts.stats().created_in_scope - before
    return {
        "python_key_ops": counting.ops,
        "cpp_key_ops": c["ops"],
        "cpp_fresh": c["fresh"],
        "cpp_alive_at_exit": len(alive),
        "ts_created": created,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--key", default="TESTING_ONLY_GenericMode", choices=list(KEY_VALUES))
    parser.add_argument("--no-generate", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated variant names (plain always)")
    parser.add_argument("--ts", default="head", choices=["head", "tree"], help="which tensorscope")
    parser.add_argument("--clock", default="thread", choices=["thread", "wall"])
    parser.add_argument("--rounds", type=int, default=0, help="override rounds of generate()")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    spike = Spike(args.key)
    variants = spike.variants()
    if args.only:
        keep = {"plain", *args.only.split(",")}
        variants = {k: v for k, v in variants.items() if k in keep}
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    rounds, steps, repeats = (3, 3, 5) if args.quick else (11, 5, 15)
    if args.rounds:
        rounds = args.rounds
    print(f"torch {torch.__version__}, 1 thread, C++ key {args.key} "
          f"(JIT build/load {_ext.build_seconds:.1f}s), Python fallback key {spike.py_key}, "
          f"tensorscope {TS_SOURCE} from {os.path.dirname(ts.__file__)}, clock: {args.clock}")

    res = per_op(variants, repeats, 20000)
    print(f"\n64-element add, µs per op ({repeats} interleaved repeats of 20000 ops)")
    print(f"{'variant':<12}{'µs/op':>8}{'added':>8}{'IQR':>7}")
    for name, (us, add, iqr) in res.items():
        print(f"{name:<12}{us:>8.2f}{add:>+8.2f}{iqr:>7.2f}")
    if args.no_generate:
        return
    for kind in ("gpt2", "llama"):
        fn = make_generate(kind)
        ops = count_ops(spike, fn)
        res_g = compare(variants, fn, rounds, steps)
        plain = res_g["plain"][0]
        print(f"\n{kind} generate() 4x256, 8 new tokens: {ops}")
        print(f"{'variant':<12}{'ms':>8}{'ratio':>8}{'range':>14}{'µs/tensor':>10}")
        for name, (sec, ratio, lo, hi) in res_g.items():
            per = (sec - plain) / ops["ts_created"] * 1e6
            print(f"{name:<12}{sec * 1e3:>8.2f}{ratio:>8.3f}{lo:>7.2f}-{hi:<6.2f}{per:>+10.2f}")


if __name__ == "__main__":
    main()
