"""Storage accounting and per-layer measurement (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensorscope.checkpoint.profile import InPlaceLayerError, flatten, measure
from tensorscope.checkpoint.tracker import StorageTracker
from tensorscope.errors import ArgumentTypeError

pytestmark = pytest.mark.engine_independent  # rotor runs plain torch ops (checked)

KIB = 1024


class SiLUBlock(nn.Module):
    """Keeps an intermediate for backward: h and sigmoid(h) are saved, plus the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * torch.sigmoid(h)


class Temporaries(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 1) * 2 + 3  # (x + 1) is freed once (x + 1) * 2 exists


class TwoOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_tracker_counts_allocations_and_frees() -> None:
    with StorageTracker() as tracker:
        a = torch.ones(256)  # 1 KiB
        view = a.view(16, 16).t()  # views allocate nothing
        a.add_(1)  # neither do in-place ops
        b = (a + 1) * 2  # a temporary, then b
        assert tracker.live_nbytes == 2 * KIB
        del a
        assert tracker.live_nbytes == 2 * KIB  # the view keeps a's storage alive
        del view
        assert tracker.live_nbytes == 1 * KIB
    assert tracker.peak_nbytes == 3 * KIB
    assert b.numel() == 256
    tracker.close()


def test_tracker_sees_storages_only_autograd_keeps() -> None:
    w = torch.randn(256, requires_grad=True)
    with StorageTracker() as tracker:
        s = torch.sigmoid(w * 2)  # sigmoid saves its output; w * 2 is freed (mul by scalar)
        y = s * 3
        del s
        assert tracker.live_nbytes == 2 * KIB  # y and the saved sigmoid output
        y.sum().backward()
        assert tracker.live_nbytes == 2 * KIB  # the graph is gone; y and w.grad remain
        tracker.reset_peak()
        keep = torch.ones(256)
        temporary = torch.ones(256)
        del temporary
        assert tracker.window_peak() == 4 * KIB
        assert tracker.window_peak([keep]) == 3 * KIB  # as if `keep` were not counted
    tracker.close()


def test_measure_sizes() -> None:
    layers = [
        nn.Linear(8, 8),
        nn.ReLU(),
        nn.Dropout(0.5),
        SiLUBlock(),
        Temporaries(),
        nn.Flatten(0),
    ]
    prof = measure(layers, torch.randn(4, 8), repeats=1)
    size = 4 * 8 * 4
    assert prof.input_nbytes == size
    got = {p.name: (p.x_nbytes, p.xbar_nbytes, p.fw_tmp_nbytes) for p in prof.layers}
    assert got["Linear"] == (size, size, 0)  # saves its input (already counted) and weight
    assert got["ReLU"] == (size, size, 0)  # saves its output
    assert got["Dropout"][0] == size and got["Dropout"][1] > size  # the mask is saved
    # xbar: the output plus the saved h and sigmoid(h); without autograd those two are transient
    assert got["SiLUBlock"] == (size, 3 * size, 2 * size)
    assert got["Temporaries"] == (size, size, size)
    assert got["Flatten"] == (size, size, 0)  # a view: counted at its storage's size
    assert all(p.fw_s >= 0 and p.bw_s >= 0 for p in prof.layers)
    chain = prof.to_chain(loss_tmp=5)
    assert [p.uses_rng for p in prof.layers] == [False, False, True, False, False, False]
    # ReLU saves its result; the others save inputs, masks or intermediates (or nothing)
    assert [p.keeps_output for p in prof.layers] == [False, True, False, False, False, False]
    assert chain.keeps_output == (False, True, False, False, False, False)
    assert chain.x_sizes[0] == size and chain.loss_tmp == 5 and chain.length == 6


def test_measure_leaves_no_trace() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(8)
    layers = [nn.Linear(8, 8), bn, nn.Dropout(0.3)]
    for m in layers:
        m.eval()
    x = torch.randn(4, 8)
    state = torch.get_rng_state()
    measure(layers, x, repeats=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert int(bn.num_batches_tracked) == 0
    assert torch.equal(bn.running_mean, torch.zeros(8))
    assert not any(m.training for m in layers)


def test_in_place_layers_are_reported() -> None:
    with pytest.raises(InPlaceLayerError, match="modifies its input in place") as err:
        measure([nn.Linear(8, 8), nn.ReLU(inplace=True)], torch.randn(4, 8), repeats=1)
    assert err.value.index == 1


def test_layers_must_return_one_tensor() -> None:
    with pytest.raises(ArgumentTypeError, match="map one tensor to one tensor"):
        measure([TwoOutputs()], torch.randn(4, 8), repeats=1)
    with pytest.raises(ArgumentTypeError):
        measure([nn.ReLU()], [1, 2], repeats=1)  # type: ignore[arg-type]


def test_flatten() -> None:
    inner = nn.Sequential(nn.ReLU(), nn.Sequential(nn.Tanh()))
    seq = nn.Sequential(nn.Linear(2, 2), inner, nn.Linear(2, 2))
    assert [type(m).__name__ for m in flatten(seq)] == ["Linear", "ReLU", "Tanh", "Linear"]
    with pytest.raises(ArgumentTypeError, match=r"needs an nn\.Sequential"):
        flatten(nn.Linear(2, 2))
