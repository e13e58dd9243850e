"""Cases of docs/api.md §8 (a moved tensor keeps its graph), run the same way under both engines.

Each case returns plain data (numbers, counts, error class names): ``test_moved_graphs.py`` runs
them in this process and checks them against plain PyTorch, and runs this file as a script under
each engine (``TENSORSCOPE_ENGINE``) to check that both engines give exactly the same data.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import tensorscope as ts
from tensorscope._engine import engine_name

Case = Callable[[], dict[str, Any]]
CASES: dict[str, Case] = {}


def case(function: Case) -> Case:
    CASES[function.__name__] = function
    return function


def _stats() -> dict[str, int]:
    s = ts.stats()
    return {
        "created_in_scope": s.created_in_scope,
        "created_outside_scope": s.created_outside_scope,
        "disposed_in_scope": s.disposed_in_scope,
        "disposed_outside_scope": s.disposed_outside_scope,
        "attached": s.attached,
        "detached": s.detached,
        "live": s.live,
    }


def _numbers(tensor: torch.Tensor) -> list[float]:
    return [round(float(v), 5) for v in tensor.detach().reshape(-1)[:8]]


def _error(run: Callable[[], object]) -> str:
    try:
        run()
    except Exception as exc:
        return type(exc).__name__
    return "no error"


def _plain_grad(compute: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor) -> list[float]:
    w = w.detach().clone().requires_grad_()
    compute(w).backward()
    assert w.grad is not None
    return _numbers(w.grad)


FORWARDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "saved_output": lambda x, w: torch.tanh(x @ w).exp().sum(),  # tanh, exp save their outputs
    "saved_input": lambda x, w: ((x * 2) @ w).pow(2).sum(),  # mm, pow save their inputs
    "saved_leaf": lambda x, w: (w * w * x.sum()).sum(),  # mul saves the leaf w
    "layer_norm": lambda x, w: nn.functional.layer_norm(x @ w, (4,)).sin().sum(),
    "softmax_view": lambda x, w: (x @ w).softmax(-1).t()[1:].square().sum(),
    "in_place": lambda x, w: (x @ w).relu_().mul(3).sum(),
    "split": lambda x, w: (lambda q, k: (q * k).sum())(*(x @ w).split(2, dim=1)),
}


def _moved_case(name: str, how: str) -> dict[str, Any]:
    torch.manual_seed(0)
    x0, w = torch.randn(3, 4), torch.randn(4, 4)
    forward = FORWARDS[name]
    ts.reset_stats()
    weight = w.clone().requires_grad_()
    with ts.scope() as outer:
        with ts.scope() as s:
            x = x0.clone()  # made in the scope: its ref is disposed at exit
            loss = forward(x, weight)
            if how == "move_to_outer":
                s.move_to_outer(loss)
            elif how == "ref.move_to_outer":
                loss.move_to_outer()
            elif how == "detach_from_scope":
                loss.detach_from_scope()
            elif how == "move_to_scope":
                loss.move_to_scope(outer)
            elif how == "exclude":
                s.exclude(loss)
            owned = len(s)
        disposed = x.is_disposed
        loss.backward()
        del loss  # an unowned loss (detach_from_scope, exclude) dies here
        assert weight.grad is not None
        grad = _numbers(weight.grad)
    return {
        "owned_before_exit": owned,
        "input_disposed": disposed,
        "grad": grad,
        "plain_grad": _plain_grad(lambda v: forward(x0, v), w),
        "stats": _stats(),
    }


for _name in FORWARDS:
    for _how in ("move_to_outer", "ref.move_to_outer", "detach_from_scope", "move_to_scope"):
        CASES[f"moved[{_name}-{_how}]"] = lambda n=_name, h=_how: _moved_case(n, h)
CASES["moved[saved_input-exclude]"] = lambda: _moved_case("saved_input", "exclude")


@case
def scoped_loss_helper() -> dict[str, Any]:
    """``@ts.scope()`` on a loss function: its returned loss keeps its graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
    batch = torch.randn(5, 4)

    @ts.scope()
    def compute_loss(inputs: torch.Tensor) -> torch.Tensor:
        return model(inputs).logsumexp(-1).mean()

    compute_loss(batch).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    model(batch).logsumexp(-1).mean().backward()
    return {
        "equal_to_plain": all(
            torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True)
        ),
        "stats": _stats(),
    }


@case
def disposed_use_raises() -> dict[str, Any]:
    """A disposed ref used directly raises, however its graph was kept."""
    w = torch.randn(4, 4, requires_grad=True)
    with ts.scope() as s:
        h = torch.tanh(torch.ones(2, 4) @ w)
        loss = s.move_to_outer(h.sum())
    return {
        "h+1": _error(lambda: h + 1),
        "h.sum()": _error(lambda: h.sum()),
        "grad wrt h": _error(lambda: torch.autograd.grad(loss, [h])),
        "grad wrt w": _numbers(torch.autograd.grad(loss, [w])[0]),
        "stats": _stats(),
    }


@case
def retain_graph_then_dispose() -> dict[str, Any]:
    """``retain_graph=True`` keeps the graph for a second backward; disposing the moved loss
    frees it (a third backward then has nothing to run)."""
    w = torch.randn(4, 4, requires_grad=True)
    with ts.scope() as s:
        loss = s.move_to_outer(torch.sin(torch.ones(3, 4) @ w).sum())
    loss.backward(retain_graph=True)
    first = _numbers(w.grad) if w.grad is not None else []
    loss.backward()
    second = _numbers(w.grad) if w.grad is not None else []
    third = _error(lambda: loss.backward())
    loss.dispose()
    return {"first": first, "second": second, "third": third, "after_dispose": loss.is_disposed}


@case
def disposed_by_hand_then_backward() -> dict[str, Any]:
    """``t.dispose()`` of an input autograd saved: the live graph keeps its data."""
    w = torch.randn(4, 4, requires_grad=True)
    x0 = torch.randn(3, 4)
    with ts.scope():
        x = x0.clone()
        loss = (x @ w).sum()
        x.dispose()
        loss.backward()
    assert w.grad is not None
    return {"grad": _numbers(w.grad), "plain": _numbers(x0.sum(0, keepdim=True).t().expand(4, 4))}


@case
def counts_of_a_forward() -> dict[str, Any]:
    """What a scope owns of a small model's forward and backward: the same on both engines."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Dropout(0.1))
    ts.reset_stats()
    with ts.scope() as s:
        out = model(torch.randn(3, 4)).sum()
        during = len(s)
        out.backward()
        after_backward = len(s)
    return {"during": during, "after_backward": after_backward, "stats": _stats()}


@case
def generator_yields_keep_graphs() -> dict[str, Any]:
    """Refs a ``@ts.scope()`` generator yields keep their graphs in the consumer."""
    w = torch.randn(3, requires_grad=True)

    @ts.scope()
    def losses() -> Any:
        for k in range(3):
            yield ((w * (k + 1)).exp()).sum()

    total = sum(loss for loss in losses())
    assert isinstance(total, torch.Tensor)
    total.backward()
    assert w.grad is not None
    return {"grad": _numbers(w.grad), "stats": _stats()}


@case
def autocast_leaf_moved() -> dict[str, Any]:
    """A leaf made in the scope under autocast: autocast's weight cache holds a weak reference
    to it, which is cleared so that disposal can hand its TensorImpl to the moved graph."""
    torch.manual_seed(0)
    x, w0 = torch.randn(4, 8), torch.randn(8, 8)
    scale = torch.ones(1, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = nn.functional.linear(x, w0.clone().requires_grad_()).float().sum() * scale
        plain.backward()
        assert scale.grad is not None
        expected = _numbers(scale.grad)
        scale.grad = None
        with ts.scope() as s:
            w = w0.clone().requires_grad_()
            loss = s.move_to_outer(nn.functional.linear(x, w).float().sum() * scale)
        loss.backward()
    assert scale.grad is not None
    return {"grad": _numbers(scale.grad), "plain": expected, "w_disposed": w.is_disposed}


def _tiny_gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


@case
def transformers_scoped_step_and_generate() -> dict[str, Any]:
    """A tiny GPT-2: a training step through a scoped loss helper, then ``generate()`` in a
    scope; what the scopes own and count is the same on both engines."""
    model = _tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    @ts.scope()
    def compute_loss(batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    ts.reset_stats()
    loss = compute_loss(ids)
    loss.backward()
    grads = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
    del loss
    step_stats = _stats()
    model.eval()
    ts.reset_stats()
    with ts.scope() as s, torch.no_grad():
        out = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
        tokens = out.tolist()
        owned = len(s)
    return {
        "grads": round(grads, 3),
        "step_stats": step_stats,
        "tokens": tokens,
        "generate_owned": owned,
        "generate_stats": _stats(),
    }


class _Scale(torch.autograd.Function):
    """Keeps a tensor as a ``ctx`` attribute, as many user Functions do."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


@case
def graph_held_through_python_objects() -> dict[str, Any]:
    """A custom Function's ``ctx`` attributes and ``torch.utils.checkpoint``'s inputs
    (reentrant: a ``partial`` whose keywords hold tensors; non-reentrant: the closure that
    recomputes) are read in backward: a moved loss keeps them."""
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(4, 4, requires_grad=True)
    x0 = torch.randn(3, 4)

    def block(h: torch.Tensor, *, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(h @ w) * pair[0] + pair[1]

    def forward(kind: str) -> torch.Tensor:
        x = x0.clone().requires_grad_()  # the reentrant checkpoint differentiates its inputs
        pair = (torch.full((4,), 2.0), torch.ones(4))
        if kind == "ctx":
            return _Scale.apply(x @ w, pair[0]).sum()
        from functools import partial

        return checkpoint(partial(block, pair=pair), x, use_reentrant=kind == "reentrant").sum()

    results: dict[str, Any] = {}
    for kind in ("ctx", "reentrant", "non-reentrant"):
        forward(kind).backward()
        assert w.grad is not None
        expected = _numbers(w.grad)
        w.grad = None
        with ts.scope() as s:
            loss = s.move_to_outer(forward(kind))
        loss.backward()
        assert w.grad is not None
        results[kind] = {"grad": _numbers(w.grad), "plain": expected}
        w.grad = None
    return results


@case
def llama_checkpointing_through_a_scoped_helper() -> dict[str, Any]:
    """HF Llama with gradient checkpointing (``position_embeddings=(cos, sin)`` reach every
    checkpointed layer as a keyword) trained through a ``@ts.scope()`` loss helper."""
    import transformers

    transformers.logging.set_verbosity_error()
    results: dict[str, Any] = {}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    for reentrant in (True, False):
        grads = []
        for scoped in (False, True):
            torch.manual_seed(0)
            config = transformers.LlamaConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
            model = transformers.LlamaForCausalLM(config).train()
            model.gradient_checkpointing_enable({"use_reentrant": reentrant})

            def compute_loss(m: nn.Module = model) -> torch.Tensor:
                return m(input_ids=ids, labels=ids).loss

            (ts.scope()(compute_loss) if scoped else compute_loss)().backward()
            grads.append(sum(float(p.grad.abs().sum()) for p in model.parameters()))
        results[f"reentrant={reentrant}"] = {
            "plain": round(grads[0], 4),
            "scoped": round(grads[1], 4),
        }
    return results


def run_all() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, function in CASES.items():
        try:
            results[name] = function()
        except Exception as exc:  # the other engine must fail the same way
            results[name] = {"raised": type(exc).__name__}
    return results


if __name__ == "__main__":
    json.dump({"engine": engine_name(), "cases": run_all()}, sys.stdout)
