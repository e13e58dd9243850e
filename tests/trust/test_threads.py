"""#2 and #3: scopes closed from another thread, and managers used from several threads."""

from __future__ import annotations

import threading

import pytest
import torch

import tensorscope as ts

from . import _models as M

# The owner thread sums a tensor of ones in a loop inside its scope; the main thread closes that
# scope meanwhile. Every sum computed must be exact (the memory is never freed under a running
# kernel); after the close the owner may get DisposedTensorError at its next use, nothing else.
CROSS_THREAD_CLOSE = r"""
import sys, threading, time, torch, tensorscope as ts
torch.set_num_threads(1)
numel, rounds, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
wrong = sums = disposed = 0
for _ in range(rounds):
    ready, closed, box, seen = threading.Event(), threading.Event(), {}, []
    def owner():
        global disposed
        with ts.scope() as s:
            x = torch.ones(numel)
            box["scope"] = s
            ready.set()
            after_close = 0
            try:
                while after_close < 3:
                    seen.append(x.sum().item())
                    after_close += closed.is_set()
            except ts.DisposedTensorError:
                disposed += 1
    thread = threading.Thread(target=owner)
    thread.start()
    ready.wait()
    time.sleep(delay)
    box["scope"].close()
    closed.set()
    thread.join()
    sums += len(seen)
    wrong += sum(v != numel for v in seen)
print(f"sums={sums} wrong={wrong} disposed={disposed}", flush=True)
"""


@pytest.mark.parametrize(
    ("numel", "rounds", "delay"),
    [(16 << 20, 5, 0.02), (1 << 18, 300, 0.001)],
    ids=["64MiB-x5", "1MiB-x300"],
)
def test_closing_a_scope_from_another_thread_never_frees_memory_under_a_running_op(
    numel: int, rounds: int, delay: float
) -> None:
    """#2: a cross-thread close never crashes or corrupts a running op; the child exits cleanly."""
    done = M.run_child(CROSS_THREAD_CLOSE, str(numel), str(rounds), str(delay), timeout=120)
    assert done.returncode == 0, M.describe(done)
    assert "wrong=0 " in done.stdout, M.describe(done)


# Weights of 256 KiB under a budget that holds one Adam op: the two threads' ops overlap long
# enough for today's overrun to show in every run (with 16 KiB weights, only in some runs).
WIDTH, DEPTH = 256, 4


def _train_in_threads(policy: str, workers: int = 2) -> None:
    """``workers`` threads each manage and train their own MLP (Adam, a scope per step) under
    one budget of 40% of all models; checks what both acceptable fixes of #3 guarantee."""
    models = [M.mlp(seed=i, width=WIDTH, depth=DEPTH) for i in range(workers)]
    batches = [M.mlp_batches(4, seed=10 + i) for i in range(workers)]
    expected = []
    for i in range(workers):
        reference = M.mlp(seed=i, width=WIDTH, depth=DEPTH)
        losses = M.train_mlp(reference, batches[i], scoped=False)
        expected.append((losses, M.state_of(reference)))

    # 40% of both models: 3.3x the largest weight, room for one Adam op (param, moment, denom).
    budget = int(0.4 * sum(M.param_bytes(m) for m in models))
    ts.residency.configure(device="cpu", policy=policy, budget=budget)
    ts.residency.report(reset=True)
    start = threading.Barrier(workers, timeout=60)
    losses: list[list[float] | None] = [None] * workers
    errors: list[BaseException | None] = [None] * workers
    steps_done = [0] * workers

    def work(i: int) -> None:
        handle = None
        try:
            handle = ts.manage(models[i])  # on this thread, as docs/residency.md asks
        except BaseException as error:
            errors[i] = error
        start.wait()
        if handle is None:
            return
        try:
            optimizer = torch.optim.Adam(models[i].parameters(), lr=1e-2)
            got: list[float] = []
            for x, y in batches[i]:
                got += M.train_mlp(models[i], [(x, y)], scoped=True, optimizer=optimizer)
                steps_done[i] += 1
            losses[i] = got
        except BaseException as error:
            errors[i] = error
        finally:
            handle.remove()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    peak = ts.residency.report().peak_bytes

    for i in range(workers):
        for name, p in models[i].named_parameters():
            assert not torch.isnan(p).any(), f"thread {i}: NaN in {name}"
        if errors[i] is not None:  # the "one clear error on the second thread" fix
            assert isinstance(errors[i], ts.TensorScopeError), f"thread {i}: {errors[i]!r}"
            assert steps_done[i] == 0, (
                f"thread {i} failed late, after {steps_done[i]} steps: {errors[i]!r}"
            )
            continue
        assert losses[i] == expected[i][0], f"thread {i}: losses differ from the sequential run"
        M.assert_same_state(models[i], expected[i][1])
    assert errors.count(None) >= 1, f"every thread failed: {errors}"
    assert peak <= budget, f"peak {peak} B > budget {budget} B ({peak / budget:.0%})"


def test_two_threads_training_their_own_managed_models_with_flow_are_exact_or_refused() -> None:
    """#3: two threads managing and training with Flow: exact, or refused at once; within budget.

    Either acceptable fix passes: per-thread accounting (each thread's losses and weights equal
    its sequential run), or one TensorScopeError on a thread before it trains. Both share: no
    NaN, no late failure, peak never above the budget (which holds one Adam op at a time, so the
    threads must wait for room rather than fail).
    """
    _train_in_threads("flow")


def test_two_threads_training_their_own_managed_models_with_genoa_stay_within_budget() -> None:
    """#3: the same with Genoa: exact, or refused at once; within budget.

    Either acceptable fix passes, as for Flow above.
    """
    _train_in_threads("genoa")
