"""A checkpoint-backed model and file events behind the manager's back (issue 15, item 2).

Harmless events (``touch``, ``rsync -t``, the same bytes written again, ``git checkout``'s
write-and-rename, ``chmod``) change nothing; a real truncation or rewrite loses exactly the
tensors whose bytes are gone or changed: they raise ``ResidencyError`` naming them, every other
tensor works on and comes back from ``remove()`` with its values, and nothing becomes zeros.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import tensorscope as ts

Loaded = tuple[nn.Sequential, Path, ts.ManagedModule]
BUDGET = 20 * 1024  # 0.weight alone is 16 KiB: the two weights cannot be resident together


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _save(model: nn.Module, path: Path) -> None:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


@pytest.fixture
def reference() -> nn.Sequential:
    torch.manual_seed(0)
    return _mlp()


@pytest.fixture
def loaded(tmp_path: Path, reference: nn.Sequential) -> Iterator[Loaded]:
    path = tmp_path / "model.safetensors"
    _save(reference, path)
    with ts.empty_init():
        model = _mlp()
    ts.residency.configure(policy="flow", budget=BUDGET)
    handle = ts.manage(model, checkpoint=path)
    yield model, path, handle


def _x() -> torch.Tensor:
    return torch.randn(3, 64, generator=torch.Generator().manual_seed(1))


def _rewrite_same_bytes(path: Path) -> None:
    data = path.read_bytes()
    with open(path, "r+b") as handle:  # the same inode, written again (rsync --inplace)
        handle.write(data)


def _write_and_rename(path: Path) -> None:  # git checkout, rsync without --inplace
    shutil.copyfile(path, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


HARMLESS: dict[str, Callable[[Path], None]] = {
    "touch": lambda p: os.utime(p),
    "rsync -t (an older mtime)": lambda p: os.utime(p, ns=(1, 1_000_000_000)),
    "same bytes written again": _rewrite_same_bytes,
    "write and rename": _write_and_rename,
    "chmod": lambda p: os.chmod(p, 0o600),
}


@pytest.mark.parametrize("event", list(HARMLESS))
def test_harmless_file_events_change_nothing(
    event: str, loaded: Loaded, reference: nn.Sequential
) -> None:
    model, path, _ = loaded
    x = _x()
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
        time.sleep(0.01)  # a new mtime even on coarse clocks
        HARMLESS[event](path)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2):  # weights demoted and promoted again under the budget
                assert torch.equal(model(x), expected)
    assert ts.residency.report().peak_bytes <= BUDGET
    ts.residency.reset()  # what remove() does to every tensor, without a warning
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert type(ours) is nn.Parameter and torch.equal(ours, theirs)


def _truncate_inside(path: Path, key: str) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt"):
        pass
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    import json

    header = json.loads(path.read_bytes()[8 : 8 + header_length])
    start = 8 + header_length + header[key]["data_offsets"][0]
    os.truncate(path, start + 100)


def test_a_truncation_loses_only_the_tensors_past_the_cut(
    loaded: Loaded, reference: nn.Sequential
) -> None:
    model, path, handle = loaded
    original = path.read_bytes()
    x = _x()
    _truncate_inside(path, "2.weight")  # 0.bias, 0.weight, 2.bias lie before it
    with torch.no_grad():
        with pytest.raises(ts.ResidencyError, match=r"bytes of 2\.weight .*truncated to"):
            model(x)
        assert torch.equal(model[0](x), reference[0](x))  # intact tensors work on
    with pytest.raises(ts.ResidencyError, match=r"every tensor but 1 .*2\.weight") as error:
        handle.remove()
    assert "0.weight" not in str(error.value) and "zeros" in str(error.value)
    assert not handle.removed
    for name, param in model.named_parameters():
        if name == "2.weight":
            assert type(param) is ts.ManagedParameter and param.tier == "disk"
        else:
            assert type(param) is nn.Parameter
            assert torch.equal(param, reference.get_parameter(name))
    with pytest.raises(ts.ResidencyError, match=r"2\.weight"):
        model[2].weight.sum()  # still raises, never reads zeros
    path.write_bytes(original)  # the file restored: the tensor is readable again
    handle.remove()
    assert handle.removed and ts.residency.managed_count() == 0
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_an_overwritten_tensor_is_named_and_a_new_value_heals_it(
    loaded: Loaded, reference: nn.Sequential
) -> None:
    model, path, handle = loaded
    changed = _mlp()
    changed.load_state_dict(reference.state_dict())
    with torch.no_grad():
        changed[2].weight.add_(1.0)  # another training run saves over the same path
    _save(changed, path.with_suffix(".new"))  # same header and size, 2.weight's bytes differ
    with open(path, "wb") as handle_file:  # written over in place (the same inode)
        handle_file.write(path.with_suffix(".new").read_bytes())
    x = _x()
    with torch.no_grad():
        with pytest.raises(ts.ResidencyError, match=r"2\.weight .*overwritten"):
            model(x)
        assert torch.equal(model[0](x), reference[0](x))
    model.load_state_dict(changed.state_dict())  # copy_ overwrites the lost tensor whole
    with torch.no_grad():
        assert torch.equal(model(x), changed(x))
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(x), changed(x))


def test_reset_lets_lost_tensors_go_as_nan_never_zeros(loaded: Loaded) -> None:
    model, path, _ = loaded
    os.truncate(path, 1000)
    with pytest.warns(ts.ResidencyWarning, match=r"0\.weight.*NaN"):
        ts.residency.reset()
    assert type(model[0].weight) is nn.Parameter
    assert torch.isnan(model[0].weight).all()


def test_a_second_manage_of_a_replaced_path_maps_the_new_file(
    loaded: Loaded, reference: nn.Sequential
) -> None:
    first, path, _ = loaded
    torch.manual_seed(5)
    other = _mlp()
    _save(other, path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)  # a new checkpoint under the same name
    with ts.empty_init():
        second = _mlp()
    ts.manage(second, checkpoint=path)
    x = _x()
    with torch.no_grad():
        assert torch.equal(first(x), reference(x))  # the old mapping, the old inode
        assert torch.equal(second(x), other(x))


def test_an_offload_file_cut_short_loses_only_the_regions_past_the_cut() -> None:
    kept = ts.ref(torch.arange(1024.0))  # 4 KiB: one page each
    cut = ts.ref(torch.arange(1024.0) + 1)
    kept.demote()
    cut.demote()
    first = ts.residency.placement_of(kept)
    second = ts.residency.placement_of(cut)
    assert first is not None and first.region is not None
    assert second is not None and second.region is not None
    assert first.region.file is second.region.file
    assert first.region.offset + first.region.nbytes <= second.region.offset
    os.ftruncate(first.region.file.fd, second.region.offset)
    kept.promote()
    assert torch.equal(kept, torch.arange(1024.0))
    with pytest.raises(ts.ResidencyError, match="truncated"):
        cut.promote()
    assert cut.tier == "disk"
    with pytest.warns(ts.ResidencyWarning, match="truncated"):
        ts.residency.reset()  # never zeros: NaN, with a warning
    assert torch.isnan(cut).all() and torch.equal(kept, torch.arange(1024.0))
