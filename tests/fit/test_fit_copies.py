"""What training scripts do to a fitted model and its optimizer: save or copy the whole
optimizer while its state waits in the disk tier (``torch.save(optimizer)``, ``pickle``,
``copy.deepcopy``), copy the whole model (an EMA with ``AveragedModel``, timm's ``ModelEmaV2``,
a "best model so far", ``torch.save(model)``). The copies are plain, hold the real values and
train on like copies of the plain loop's objects; the fitted originals go on bit-identically.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import tensorscope as ts
from tensorscope.checkpoint import checkpoint_chain
from tensorscope.errors import ResidencyError
from tensorscope.fit.offload import offload_blocks
from tensorscope.fit.placeholders import Placeholder

from .fit_helpers import (
    MLPChain,
    batches,
    differing,
    optimizer,
    step,
    tight_state_budget,
    tiny,
    twin,
)


def _saved(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


# how a script copies: (what runs where the script copies -- inside a scope in some tests --,
# what turns that into the copy, run after it, outside any scope)
COPIES: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "torch.save": (_saved, lambda buffer: torch.load(buffer, weights_only=False)),
    "pickle": (pickle.dumps, pickle.loads),
    "deepcopy": (copy.deepcopy, lambda copied: copied),
    "copy.copy": (copy.copy, lambda copied: copied),
}


def _copied(how: str, value: Any, scoped: bool = False) -> Any:
    dump, load = COPIES[how]
    with ts.scope() if scoped else contextlib.nullcontext():
        dumped = dump(value)
    return load(dumped)


def _state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for key, value in sb[k].items():
            assert torch.equal(sa[k][key], value), (k, key)


def _plain(model: nn.Module) -> None:
    """Nothing of ts.fit's is left on a copy."""
    assert not model._forward_pre_hooks and not model._forward_hooks
    for module in model.modules():
        assert "forward" not in vars(module) and "__getstate__" not in vars(module)


def _placeholders(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, Placeholder)]


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_whole_optimizer_saved_with_its_state_in_the_disk_tier_resumes_exactly(
    how: str, clip: float | None
) -> None:
    budget = tight_state_budget("gpt2", "adamw", clip)
    model = tiny("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    mine, theirs = batches("gpt2"), batches("gpt2")
    for i in range(3):
        assert step(model, opt, next(mine), seed=i, clip=clip) == step(
            ref, ropt, next(theirs), seed=i, clip=clip
        )
    placeholders = _placeholders(opt)
    assert placeholders and all(v.device.type == "meta" for v in placeholders)
    # a script's checkpoint: the model and its optimizer in one file (saved inside a scope:
    # what the placeholders read back is the script's, never the scope's)
    copied, copied_opt = _copied(how, (model, opt), scoped=True)
    plain, plain_opt = copy.deepcopy((ref, ropt))
    assert _placeholders(opt) == placeholders  # the originals are as they were
    _plain(copied)
    assert not _placeholders(copied_opt)
    state = [v for s in copied_opt.state.values() for v in s.values()]
    assert state and all(type(v) is torch.Tensor and v.device.type == "cpu" for v in state)
    assert {id(p) for g in copied_opt.param_groups for p in g["params"]} == {
        id(p) for p in copied.parameters()
    }
    _state_equal(copied_opt, plain_opt)
    for i in range(3, 6):  # the copy resumes as the plain copy does; the fitted one goes on
        batch = next(mine)
        assert step(copied, copied_opt, batch, seed=i, clip=clip) == step(
            plain, plain_opt, batch, seed=i, clip=clip
        )
        assert step(model, opt, batch, seed=i, clip=clip) == step(
            ref, ropt, batch, seed=i, clip=clip
        )
    assert not differing(copied, plain) and not differing(model, ref)
    _state_equal(copied_opt, plain_opt)
    assert fit.steps == 6 and _placeholders(opt)  # the copy's steps are not the fit's
    _state_equal(opt, ropt)
    fit.remove()


def test_a_copy_of_the_optimizer_alone_holds_the_real_state() -> None:
    budget = tight_state_budget("mlp", "sgd", None)
    model = tiny("mlp")
    ref = twin(model)
    opt, ropt = optimizer("sgd", model), optimizer("sgd", ref)
    fit = ts.fit(model, opt, budget=budget)
    mine, theirs = batches("mlp"), batches("mlp")
    for i in range(3):
        step(model, opt, next(mine), seed=i)
        step(ref, ropt, next(theirs), seed=i)
    assert _placeholders(opt)
    copied = copy.deepcopy(opt)  # param_groups hold copies of the parameters, as in torch
    for (p, values), q in zip(copied.state.items(), ref.parameters(), strict=True):
        assert p is not q and torch.equal(p, q)
        assert torch.equal(values["momentum_buffer"], ropt.state[q]["momentum_buffer"])
    fit.remove()


def test_a_placeholder_no_longer_in_the_state_cannot_be_copied() -> None:
    budget = tight_state_budget("mlp", "sgd", None)
    model = tiny("mlp")
    opt = optimizer("sgd", model)
    fit = ts.fit(model, opt, budget=budget)
    data = batches("mlp")
    for i in range(3):
        step(model, opt, next(data), seed=i)
    held = _placeholders(opt)[0]
    copy.deepcopy(held)  # in the state: copies as its value
    step(model, opt, next(data), seed=3)  # read back and written out again: a new stand-in
    assert all(v is not held for v in _placeholders(opt))
    with pytest.raises(ResidencyError, match=r"optimizer\.state_dict\(\)"):
        copy.deepcopy(held)
    with pytest.raises(ResidencyError, match=r"optimizer\.state_dict\(\)"):
        pickle.dumps(held)
    fit.remove()


@pytest.mark.parametrize(
    ("name", "how"),
    [("gpt2", "deepcopy"), ("gpt2", "torch.save"), ("mlp", "pickle"), ("mlp", "copy.copy")],
)
def test_a_copy_of_a_fitted_model_is_a_plain_model_and_the_original_trains_on(
    name: str, how: str
) -> None:
    budget = tight_state_budget(name, "adamw", None)
    model = tiny(name)
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    mine, theirs = batches(name), batches(name)
    for i in range(4):
        step(model, opt, next(mine), seed=i)
        step(ref, ropt, next(theirs), seed=i)
        if i == 1:
            copied, plain = _copied(how, model, scoped=True), copy.deepcopy(ref)
            if how == "copy.copy":  # shares the submodules, as a shallow copy does in torch
                assert not copied._forward_pre_hooks and not copied._forward_hooks
                assert "__getstate__" not in vars(copied)
                assert list(copied.children()) == list(model.children())
            else:
                _plain(copied)
            assert not differing(copied, ref)
    assert fit.chain is not None and fit.decision is not None
    assert "recompute" in fit.decision.blocks  # the original still runs its schedule
    assert not differing(model, ref)
    if how != "copy.copy":  # a shallow copy shares the parameters, as it does in torch
        copied_opt, plain_opt = optimizer("adamw", copied), optimizer("adamw", plain)
        batch = next(theirs)
        assert step(copied, copied_opt, batch, seed=9) == step(plain, plain_opt, batch, seed=9)
        assert not differing(copied, plain)
        assert fit.steps == 4
    fit.remove()
    _plain(model)


def _ema_v2_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """timm's ``ModelEmaV2.update`` (the EMA's module made with ``copy.deepcopy(model)``)."""
    with torch.no_grad():
        for e, m in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
            e.copy_(e * decay + (1.0 - decay) * m)


@pytest.mark.parametrize("scoped", [False, True])
def test_an_ema_of_a_fitted_model_follows_the_plain_ones_ema(scoped: bool) -> None:
    budget = tight_state_budget("gpt2", "adamw", 1.0)
    model = tiny("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    plain_averaged = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema, plain_ema = copy.deepcopy(model), copy.deepcopy(ref)
    mine, theirs = batches("gpt2"), batches("gpt2")
    for i in range(5):
        assert step(model, opt, next(mine), seed=i, clip=1.0, scoped=scoped) == step(
            ref, ropt, next(theirs), seed=i, clip=1.0, scoped=scoped
        )
        with ts.scope() if scoped else contextlib.nullcontext():
            averaged.update_parameters(model)
            plain_averaged.update_parameters(ref)
            _ema_v2_update(ema, model, 0.9)
            _ema_v2_update(plain_ema, ref, 0.9)
        assert not differing(model, ref)
        assert not differing(averaged, plain_averaged)
        assert not differing(ema, plain_ema)
    assert fit.decision is not None and fit.decision.chosen.base.state_offloaded
    _plain(averaged.module)
    _plain(ema)
    batch = next(mine)
    ema.eval(), plain_ema.eval()
    with torch.no_grad():
        assert torch.equal(ema(**batch).logits, plain_ema(**batch).logits)
    fit.remove()


def test_copies_of_a_routed_chain_and_of_offloaded_blocks_are_plain() -> None:
    torch.manual_seed(0)
    model = MLPChain(32, 4).eval()
    chain = checkpoint_chain(model)
    handle = offload_blocks(model.layers)
    x = torch.randn(8, 16)
    with torch.no_grad():
        expected = model(x)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        _plain(copied)
        assert not any(layer._forward_pre_hooks for layer in copied.layers)
        with torch.no_grad():
            assert torch.equal(copied(x), expected)
    assert all("forward" in vars(layer) for layer in model.layers)  # the original's stay
    assert all(layer._forward_pre_hooks for layer in model.layers)
    handle.remove()
    chain.remove()
    _plain(model)
