"""An HF causal LM's loss in row chunks (tensorscope/fit/causal_lm.py): training with the
chunked forward attached follows plain training (allclose), ``outputs.logits`` is ``None``,
every other call runs the model's own forward, and attach/detach leave the model as it was."""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.fit.causal_lm import ChunkedCausalLM

from .fit_helpers import BIG_VOCAB, big_vocabulary

BATCH, SEQ = 4, 32


def _batches() -> Iterator[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(0, BIG_VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[0, SEQ - 5 :] = 0  # padding, not in the loss
        labels = ids.masked_fill(mask == 0, -100)
        yield {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _train(model: nn.Module, steps: int, scoped: bool) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    data = _batches()
    for k in range(steps):
        torch.manual_seed(k)  # the same dropout masks in both runs
        with ts.scope() if scoped else contextlib.nullcontext():
            out = model(**next(data))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
    return losses


def _close(a: nn.Module, b: nn.Module) -> None:
    # AdamW divides each update by the root of its gradient's running square: gradients
    # allclose at rtol 1e-5 give updates that differ by up to about 1e-3 of lr (1e-3) after a
    # few steps where a gradient is small beside the sums it is made of
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("scoped", [False, True])
def test_three_adamw_steps_follow_plain_training(name: str, scoped: bool) -> None:
    plain = big_vocabulary(name)
    model = copy.deepcopy(plain)
    chunked = ChunkedCausalLM(model, chunk_bytes=64 << 10)  # 4 rows of 4096 words a chunk
    assert chunked.reason is None
    chunked.attach()
    seen: list[Any] = []
    hook = model.register_forward_hook(lambda module, args, out: seen.append(out.logits))
    losses = _train(model, 3, scoped)
    hook.remove()
    assert seen == [None, None, None] and chunked.chunked == 3 and chunked.last_reason is None
    torch.testing.assert_close(losses, _train(plain, 3, scoped), rtol=1e-5, atol=0)
    _close(model, plain)


def _largest_made(model: nn.Module) -> int:
    """The largest storage a recorded training step of ``model`` makes, in bytes."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ts.record() as rec:
        model(**next(_batches())).loss.backward()
        opt.step()
    return max(life.nbytes for life in rec.plan().lifetimes if life.created >= 0)


def test_a_recorded_step_never_holds_the_logits() -> None:
    logits = BATCH * SEQ * BIG_VOCAB * 4  # 2 MiB; the head's weight is 512 KiB
    plain = big_vocabulary("gpt2")
    model = copy.deepcopy(plain)
    ChunkedCausalLM(model, chunk_bytes=64 << 10).attach()
    assert _largest_made(plain) >= logits
    assert _largest_made(model) <= BIG_VOCAB * 32 * 4  # the head's gradient, at most


def test_every_output_but_the_logits_is_the_models() -> None:
    plain = big_vocabulary("gpt2")
    model = copy.deepcopy(plain)
    ChunkedCausalLM(model).attach()
    batch = next(_batches())
    torch.manual_seed(0)
    mine = model(**batch, output_hidden_states=True, output_attentions=True)
    torch.manual_seed(0)
    theirs = plain(**batch, output_hidden_states=True, output_attentions=True)
    assert type(mine) is type(theirs) and mine.logits is None
    assert set(theirs.keys()) - set(mine.keys()) == {"logits"}
    for key in mine.keys() - {"loss"}:
        for a, b in zip(mine[key], theirs[key], strict=True):
            assert torch.equal(a, b), key
    torch.testing.assert_close(mine.loss, theirs.loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kwarg", ["num_items_in_batch", "shift_labels", "ignore_index"])
def test_the_loss_keywords_of_for_causal_lm_loss(kwarg: str) -> None:
    plain = big_vocabulary("llama")
    model = copy.deepcopy(plain)
    chunked = ChunkedCausalLM(model)
    chunked.attach()
    batch = next(_batches())
    extra: dict[str, Any] = {
        "num_items_in_batch": torch.tensor(100),
        "shift_labels": torch.roll(batch["input_ids"], 3, dims=1),
        "ignore_index": int(batch["labels"][1, 4]),
    }
    if kwarg == "ignore_index":  # then -100 is a class index: no padding in the labels
        batch["labels"] = batch["input_ids"]
    mine = model(**batch, **{kwarg: extra[kwarg]})
    theirs = plain(**batch, **{kwarg: extra[kwarg]})
    assert chunked.last_reason is None and mine.logits is None
    torch.testing.assert_close(mine.loss, theirs.loss, rtol=1e-5, atol=0)
    mine.loss.backward()
    theirs.loss.backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def _calls_that_run_plain() -> list[tuple[str, dict[str, Any], str]]:
    return [
        ("no labels", {"labels": None}, "no labels"),
        ("eval", {"eval": True}, "eval mode"),
        ("no grad", {"no_grad": True}, "gradients are disabled"),
        ("keep", {"logits_to_keep": 1, "last": True}, "logits_to_keep=1"),
        ("tuple", {"return_dict": False}, "return_dict=False"),
        ("deprecated", {"past_key_values": None}, "deprecated keyword past_key_values"),
    ]


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize(("case", "change", "reason"), _calls_that_run_plain())
def test_other_calls_run_the_models_own_forward(
    case: str, change: dict[str, Any], reason: str
) -> None:
    plain = big_vocabulary("llama")
    model = copy.deepcopy(plain)
    chunked = ChunkedCausalLM(model)
    chunked.attach()
    call = next(_batches()) | change
    grad = not call.pop("no_grad", False)
    for m in (model, plain):
        m.train(not call.get("eval", False))
    call.pop("eval", None)
    if call.pop("last", False):  # the labels of the logits kept
        call["labels"] = call["labels"][:, -1:]
    with torch.set_grad_enabled(grad):
        mine, theirs = model(**call), plain(**call)
    assert chunked.last_reason is not None and reason in chunked.last_reason
    assert chunked.chunked == 0
    mine_list = list(mine.values()) if isinstance(mine, dict) else list(mine)
    theirs_list = list(theirs.values()) if isinstance(theirs, dict) else list(theirs)
    assert len(mine_list) == len(theirs_list)
    for a, b in zip(mine_list, theirs_list, strict=True):
        if isinstance(a, torch.Tensor):  # one label kept: shifted out, a loss of nan
            assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all())


def test_generate_while_attached() -> None:
    plain = big_vocabulary("gpt2").eval()
    model = copy.deepcopy(plain).train()
    chunked = ChunkedCausalLM(model)
    chunked.attach()
    prompt = torch.randint(0, BIG_VOCAB, (2, 5))
    mask = torch.ones_like(prompt)
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    model.eval()
    mine = model.generate(prompt, attention_mask=mask, **settings)
    theirs = plain.generate(prompt, attention_mask=mask, **settings)
    assert torch.equal(mine, theirs) and mine.shape == (2, 9)
    assert chunked.chunked == 0 and chunked.last_reason is not None


def test_detach_restores_the_exact_forward() -> None:
    model = big_vocabulary("gpt2")
    chunked = ChunkedCausalLM(model)
    chunked.attach()
    assert chunked.attached and "forward" in vars(model)
    with pytest.raises(ts.InvalidArgumentError, match="already attached"):
        chunked.attach()
    chunked.detach()
    chunked.detach()  # idempotent
    assert not chunked.attached and "forward" not in vars(model)
    assert model.forward.__func__ is type(model).forward
    own = model.forward  # an instance forward of the user's: kept, and the call runs it
    calls: list[int] = []

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return own(*args, **kwargs)

    model.forward = forward
    chunked.attach()
    out = model(**next(_batches()))
    assert out.logits is not None and calls == [1]
    assert chunked.last_reason is not None and "replaced on the instance" in chunked.last_reason
    chunked.detach()
    assert vars(model)["forward"] is forward


def test_detach_refuses_to_drop_a_later_forward() -> None:
    model = big_vocabulary("gpt2")
    chunked = ChunkedCausalLM(model)
    chunked.attach()
    ours = model.forward
    model.forward = lambda *a, **k: None
    with pytest.raises(ts.InvalidArgumentError, match="replaced after"):
        chunked.detach()
    model.forward = ours
    chunked.detach()
    assert "forward" not in vars(model)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_while_attached_are_plain_models(how: str) -> None:
    model = big_vocabulary("llama")
    chunked = ChunkedCausalLM(model)
    chunked.attach()
    twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert "forward" not in vars(twin) and "forward" in vars(model)
    out = twin(**next(_batches()))
    assert out.logits is not None and chunked.chunked == 0
    chunked.detach()
    assert "__getstate__" not in vars(model)


def test_what_it_cannot_reproduce_runs_plain_with_a_reason() -> None:
    model = big_vocabulary("llama")
    chunked = ChunkedCausalLM(model)
    chunked.attach()
    batch = next(_batches())
    hook = model.lm_head.register_forward_hook(lambda *args: None)
    assert model(**batch).logits is not None
    assert chunked.last_reason is not None and "hooks" in chunked.last_reason
    hook.remove()
    model.loss_function = lambda **kwargs: torch.zeros(())  # a custom loss
    assert model(**batch).logits is not None
    assert chunked.last_reason is not None and "loss_function" in chunked.last_reason
    del model._loss_function
    assert model(**batch).logits is None and chunked.last_reason is None


def _tiny(kind: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    common: dict[str, Any] = {
        "num_hidden_layers": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 512,
    }
    if kind == "gemma2":
        config = tf.Gemma2Config(head_dim=8, final_logit_softcapping=4.0, **common)
        return tf.Gemma2ForCausalLM(config).train()
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)).train()
    if kind == "mixtral":
        config = tf.MixtralConfig(num_local_experts=2, output_router_logits=True, **common)
        return tf.MixtralForCausalLM(config).train()
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["gemma2", "qwen2"])
def test_other_architectures_in_the_plain_form(kind: str) -> None:
    plain = _tiny(kind)
    model = copy.deepcopy(plain)
    chunked = ChunkedCausalLM(model, chunk_bytes=8 << 10)
    chunked.attach()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    mine, theirs = model(ids, labels=ids), plain(ids, labels=ids)
    assert chunked.last_reason is None and mine.logits is None
    torch.testing.assert_close(mine.loss, theirs.loss, rtol=1e-5, atol=0)
    mine.loss.backward()
    theirs.loss.backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_a_router_loss_runs_plain_with_its_reason() -> None:
    model = _tiny("mixtral")
    chunked = ChunkedCausalLM(model)
    assert chunked.reason is not None and "aux_loss" in chunked.reason
    chunked.attach()
    ids = torch.randint(0, 512, (2, 12))
    out = model(ids, labels=ids)
    assert out.logits is not None and out.aux_loss is not None
    assert chunked.last_reason == chunked.reason


def test_models_that_are_not_causal_lms_are_refused() -> None:
    import transformers as tf

    t5 = tf.T5ForConditionalGeneration(
        tf.T5Config(num_layers=1, d_model=16, d_ff=32, num_heads=2, d_kv=8, vocab_size=64)
    )
    with pytest.raises(ts.InvalidArgumentError, match="encoder-decoder"):
        ChunkedCausalLM(t5)
    bert = tf.BertForMaskedLM(
        tf.BertConfig(
            num_hidden_layers=1,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            vocab_size=64,
        )
    )
    with pytest.raises(ts.InvalidArgumentError, match="not a causal LM"):
        ChunkedCausalLM(bert)
    with pytest.raises(ts.ArgumentTypeError, match="PreTrainedModel"):
        ChunkedCausalLM(nn.Linear(2, 2))
    with pytest.raises(ts.InvalidArgumentError, match="chunk_bytes"):
        ChunkedCausalLM(big_vocabulary("gpt2"), chunk_bytes=0)
