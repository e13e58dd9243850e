"""A multi-worker ``DataLoader`` whose ``next()`` runs inside scopes (item 6).

Two workers, ``persistent_workers`` on and off, two epochs; each step calls ``next()`` inside its
scope and trains on the batch; when an epoch ends, the next epoch's iterator is made inside that
step's scope. Every even batch is slow to load, so the odd batch made by the other worker arrives
first and waits in the loader's reorder buffer while the step that asked for the even batch (and
its scope) is still running. Batches, losses and final parameters must equal a run without
tensorscope with the same loader.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import tensorscope as ts

from . import _models as M

BATCH = 4
BATCHES_PER_EPOCH = 4
EPOCHS = 2


class SlowEvenBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Deterministic samples; the first item of every even batch sleeps."""

    def __len__(self) -> int:
        return BATCH * BATCHES_PER_EPOCH

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index % (2 * BATCH) == 0:
            time.sleep(0.15)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=generator), torch.randn(4, generator=generator)


def _loader(persistent: bool) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    return DataLoader(
        SlowEvenBatches(),
        batch_size=BATCH,
        shuffle=False,
        num_workers=2,
        persistent_workers=persistent,
        prefetch_factor=2,
    )


def _shut_down(iterator: object) -> None:
    """Stop the workers now: a failed test's traceback would keep the iterator (and its
    workers) alive until garbage collection, whose shutdown then waits for their timeouts."""
    shut_down = getattr(iterator, "_shutdown_workers", None)
    if shut_down is not None:
        shut_down()


def _train_from_loader(mode: str, persistent: bool) -> tuple[torch.nn.Module, list[object]]:
    model = M.mlp()
    run = M.Run(mode)
    run.manage(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = _loader(persistent)
    iterator = iter(loader)
    record: list[object] = []
    try:
        for _ in range(EPOCHS * BATCHES_PER_EPOCH):
            with run.step():
                try:
                    x, y = next(iterator)
                except StopIteration:
                    iterator = iter(loader)  # the next epoch's iterator, made inside a scope
                    x, y = next(iterator)
                record.append((x.tolist(), y.tolist()))
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                record.append(loss.item())
        with pytest.raises(StopIteration):
            next(iterator)
    finally:
        _shut_down(iterator)
    run.check_budget()
    return model, record


@functools.cache
def _plain(persistent: bool) -> tuple[list[object], dict[str, torch.Tensor]]:
    model, record = _train_from_loader("plain", persistent)
    return record, M.state_of(model)


@pytest.mark.parametrize("mode", M.MODES)
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_batches_fetched_inside_scopes_match_plain(persistent: bool, mode: str) -> None:
    expected_record, expected_state = _plain(persistent)
    model, record = _train_from_loader(mode, persistent)
    assert len(record) == len(expected_record)
    for i, (got, want) in enumerate(zip(record, expected_record, strict=True)):
        assert got == want, f"record {i} (step {i // 2}) differs"
    M.assert_same_state(model, expected_state)


@pytest.mark.parametrize("made", ["iterator_made_before", "iterator_made_in_first_scope"])
def test_a_batch_waiting_in_the_reorder_buffer_survives_the_scope_that_received_it(
    made: str,
) -> None:
    """The mechanism above, reduced: iterate, one scope per ``next()``, no training."""
    loader = _loader(persistent=False)
    expected = [x.clone() for x, _ in loader]
    got = []
    iterator = iter(loader) if made == "iterator_made_before" else None
    try:
        for _ in range(BATCHES_PER_EPOCH):
            with ts.scope():
                if iterator is None:
                    iterator = iter(loader)
                x, _ = next(iterator)
                got.append(M.plain_copy(x))
    finally:
        _shut_down(iterator)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"batch {i}"
