"""Spike: correctness experiments for the C++ fallback (hotpath.cpp), per dispatch key.

Run: ``.venv/bin/python docs/spikes/hotpath/correctness.py`` (runs itself once per key in a
subprocess: a process registers the fallback on one key only). Prints one line per finding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
KEYS = ["TESTING_ONLY_GenericMode", "DeferredInit"]


def run_all(key: str, mode: int) -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import _ext

    ext = _ext.load()
    ref_class = type("TensorRef", (torch.Tensor,), {"__torch_function__": torch._C._disabled_torch_function_impl})
    if not ext.install(key):
        print(f"[{key}] install refused: the key already has a fallback")
        return
    verdicts: dict = {}
    torch_dir = os.path.dirname(torch.__file__)

    def classify(code):  # 0 user, 1 library, 2 state maker (torch._dynamo / _inductor)
        f = code.co_filename
        v = 2 if ("/_dynamo/" in f or "/_inductor/" in f) else 1 if f.startswith(torch_dir) else 0
        verdicts[code] = v
        return v

    ext.configure(mode, ref_class if mode >= 2 else None, verdicts, classify)

    def say(name: str, text: str) -> None:
        print(f"[{key} mode {mode}] {name}: {text}")

    class frame:  # one scope frame of the extension
        def __enter__(self):
            ext.reset_counters()
            ext.push()
            return self

        def __exit__(self, *exc):
            self.counters = ext.counters()
            self.alive, self.recorded, self.freed = ext.pop()
            self.alive_ids = {id(t) for t in self.alive}
            return False

        def owns(self, t):
            return id(t) in self.alive_ids

    def check(name, fn):
        try:
            say(name, fn())
        except Exception as exc:  # noqa: BLE001
            say(name, f"EXCEPTION {type(exc).__name__}: {exc}".splitlines()[0])
            traceback.print_exc(limit=3)

    a = torch.randn(4)

    # 1. factories, views, in-place, out=, lift_fresh, chunk (TensorList results)
    def basics():
        with frame() as f:
            z = torch.zeros(3)
            v = a.view(2, 2)
            a.add_(0)
            out = torch.empty(4)
            torch.add(a, a, out=out)  # out is recorded by empty(), not again by add.out
            lit = torch.tensor([1.0, 2.0])
            parts = torch.randn(6).chunk(3)
            idx = [a[1:], a[0], a[a > 0], a[[0, 1]]]
            r = [type(x).__name__ for x in (z, v, lit, parts[0])]
        return (
            f"zeros owned={f.owns(z)} view owned={f.owns(v)} input `a` owned={f.owns(a)} "
            f"tensor() owned={f.owns(lit)} chunk owned={all(f.owns(p) for p in parts)} "
            f"indexing owned={[f.owns(t) for t in idx]}; "
            f"classes {r}; ops {f.counters['ops']} fresh {f.counters['fresh']}"
        )

    check("factories/views/in-place/out=/tensor()/chunk", basics)

    # 2. inference mode: a no-op .to() returns its input; results are inference tensors
    def inference():
        with torch.inference_mode():
            x = torch.randn(3)
            with frame() as f:
                same = x.to(torch.float32)
                cont = x.contiguous()
                y = x * 2
        return (
            f"no-op .to() is input={same is x} owned={f.owns(same)}; contiguous() owned={f.owns(cont)}; "
            f"x*2 owned={f.owns(y)} inference={y.is_inference()}"
        )

    check("inference_mode", inference)

    # 3. autograd: forward ops seen once (above Autograd); backward ops run by the engine
    def backward():
        w = torch.randn(4, requires_grad=True)
        with frame() as f:
            loss = (w * 3).sin().sum()
            before = ext.counters()
            loss.backward()
            after = ext.counters()
        graph = f.owns(loss)
        return (
            f"forward ops {before['ops']}; backward ops passed through in C++: "
            f"{after['backward_ops'] - before['backward_ops']}; loss owned={graph}; "
            f"w.grad owned={f.owns(w.grad)}; grad correct={torch.allclose(w.grad, 3 * (w * 3).cos())}; "
            f"ops seen inside AccumulateGrad {after['grads'] - before['grads']}"
        )

    check("backward inside a scope", backward)

    def backward_outside():
        w = torch.randn(4, requires_grad=True)
        with frame() as f:
            loss = (w * 3).sin().sum()
        ext.reset_counters()
        loss.backward()  # the engine snapshots TLS at backward(): no scope open here
        return f"backward outside the scope: backward_ops seen {ext.counters()['backward_ops']}"

    check("backward outside", backward_outside)

    def grad_api():
        w = torch.randn(4, requires_grad=True)
        with frame() as f:
            (g,) = torch.autograd.grad((w * w).sum(), w, create_graph=True)
            c = ext.counters()
        return f"autograd.grad result owned={f.owns(g)}, backward_ops {c['backward_ops']}"

    check("torch.autograd.grad", grad_api)

    # 4. autocast: the cached weight cast is made below our key (excluded): never recorded
    def autocast():
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(2, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with frame() as f:
                y = lin(x)
                y2 = lin(x)
        return (
            f"linear under autocast: ops {f.counters['ops']}, fresh {f.counters['fresh']}, "
            f"y owned={f.owns(y)} dtype={y.dtype}; recorded {f.recorded} (2 outputs expected)"
        )

    check("autocast", autocast)

    # 5. threads: the included key set is per thread
    def threads():
        box = {}

        def other():
            box["included"] = ext.is_included()
            box["t"] = torch.ones(2) * 2

        with frame() as f:
            th = threading.Thread(target=other)
            th.start()
            th.join()
        return f"other thread: key included={box['included']}, its tensor owned={f.owns(box['t'])}"

    check("threads", threads)

    # 6. a Python dispatch mode active inside the scope (e.g. tensorscope's residency mode)
    def python_mode():
        class M(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with frame() as f:
            with M():
                y = a * 2
                z = y + 1
            c = ext.counters()
        return (
            f"ops {c['ops']} (2 user ops), recorded {f.recorded} (2 expected), "
            f"y owned={f.owns(y)} z owned={f.owns(z)}"
        )

    check("Python TorchDispatchMode inside", python_mode)

    # 7. subclasses: nn.Parameter (_make_subclass), as_subclass, register_buffer
    def params():
        with frame() as f:
            lin = torch.nn.Linear(3, 3)
            p = torch.nn.Parameter(torch.randn(2))
            sub = torch.randn(2).as_subclass(ref_class)
            m = torch.nn.Module()
            m.register_buffer("b", torch.zeros(2))
        kinds = sorted(type(t).__name__ for t in f.alive)
        kinds.append(f"subclass aliases skipped {f.counters['subclass_alias']}")
        return (
            f"nn.Linear weight {type(lin.weight).__name__}, Parameter {type(p).__name__}, "
            f"as_subclass {type(sub).__name__}, buffer {type(m.b).__name__}; "
            f"alive at exit (would be disposed unless filtered by class): {kinds}"
        )

    check("Parameter/as_subclass/buffer", params)

    # 8. torch.func (functorch): vmap and grad inside a scope
    def functorch():
        x = torch.randn(3, 4)
        with frame() as f:
            y = torch.func.vmap(lambda r: r.sin() * 2)(x)
            g = torch.func.grad(lambda r: r.sin().sum())(x[0])
            c = ext.counters()
        ok = torch.allclose(y, x.sin() * 2) and torch.allclose(g, x[0].cos())
        return (
            f"results correct={ok}; y owned={f.owns(y)} grad owned={f.owns(g)}; ops {c['ops']} "
            f"fresh {c['fresh']} python-key results skipped {c['skipped_python']}"
        )

    check("torch.func vmap/grad", functorch)

    # 9. torch.compile: tracing with FakeTensors on this thread, and compiled outputs
    def compiled():
        import torch._dynamo

        torch._dynamo.reset()

        def fn(x):
            return (x.sin() + 1) * 2

        cfn = torch.compile(fn, backend=os.environ.get("SPIKE_COMPILE_BACKEND", "inductor"))
        x = torch.randn(8)
        with frame() as f:
            y = cfn(x)  # compiles here, with the key included
            c = ext.counters()
        with frame() as f2:
            y2 = cfn(x)  # cached graph
            c2 = ext.counters()
        y3 = cfn(x)  # after both scopes, outside
        ok = torch.allclose(y, fn(x)) and torch.allclose(y2, fn(x)) and torch.allclose(y3, fn(x))
        return (
            f"first call (compiles): ops {c['ops']}, fresh {c['fresh']}, fake/python skipped "
            f"{c['skipped_python']}, state-maker frames {c['not_owned']}, output owned={f.owns(y)}, "
            f"alive at exit {len(f.alive)}; cached call: ops {c2['ops']} fresh {c2['fresh']} output "
            f"owned={f2.owns(y2)}; results correct={ok}"
        )

    check("torch.compile", compiled)

    # 10. disposal of what the extension returns at exit, and sweeping of dead entries
    def dispose():
        keep = []
        with frame() as f:
            for i in range(10000):
                t = torch.ones(16) + i
                if i % 1000 == 0:
                    keep.append(t)
        return f"10000 results, 10 kept alive: recorded {f.recorded}, freed {f.freed}, alive {len(f.alive)}"

    check("sweep/alive at exit", dispose)


def second_copy(key: str) -> None:
    """Load a second copy of the extension (another module name) and install on the same key."""
    import torch
    from torch.utils.cpp_extension import load

    import _ext

    ext = _ext.load()
    print(f"[{key}] first copy install: {ext.install(key)}")
    ext2 = load(
        name="ts_hotpath_spike_copy",
        sources=[os.path.join(HERE, "hotpath.cpp")],
        build_directory=_ext.BUILD_DIR + "_copy",
        extra_cflags=["-O2"],
    ) if os.makedirs(_ext.BUILD_DIR + "_copy", exist_ok=True) is None else None
    print(f"[{key}] second copy: has_fallback={ext2.has_fallback(key)} install -> {ext2.install(key)}")
    try:
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(lambda op, *a, **k: op(*a, **k), key)
        print(f"[{key}] a Python fallback on the same key: registered (!)")
    except RuntimeError as exc:
        print(f"[{key}] a Python fallback on the same key: {str(exc).splitlines()[0][:160]}")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        key, mode = sys.argv[2], int(sys.argv[3])
        if mode < 0:
            second_copy(key)
        else:
            run_all(key, mode)
        sys.exit(0)
    for key in KEYS:
        for mode in (1, 3, -1):
            subprocess.run([sys.executable, __file__, "--child", key, str(mode)], check=False)
