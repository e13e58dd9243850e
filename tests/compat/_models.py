"""Tiny, seeded models and data shared by the compatibility tests.

Every transformers model is built from a tiny config (2 layers, hidden 64, vocab 128) with random
weights: nothing is downloaded. Builders are deterministic: the same name always gives the same
weights, so a plain run and a run under tensorscope start from identical models.

The sizes are chosen so that a residency budget of 40% of the parameters' total size is still at
least five times the largest parameter: AdamW touches a parameter, its gradient and two moments
in one op, and residency requires one op's operands to fit the budget (docs/residency.md).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tensorscope as ts

VOCAB = 128
HIDDEN = 64
SEQ = 8
BATCH = 2
BUDGET_FRACTION = 0.4

CAUSAL_LMS = ("gpt2", "llama", "qwen2")
SEQ2SEQ = ("t5",)
GENERATIVE = (*CAUSAL_LMS, *SEQ2SEQ)
HF_MODELS = ("gpt2", "bert", "llama", "t5", "qwen2")
ROTARY = ("llama", "qwen2")

# "scope": a ``with ts.scope():`` around each step or call. "flow"/"genoa": the model is managed
# under a budget below its parameters' size (that policy), plus a scope around each step.
MODES = ("scope", "flow", "genoa")
RESIDENCY_MODES = ("flow", "genoa")


# ----------------------------------------------------------------------------- transformers


def _config(name: str) -> Any:
    import transformers as tf

    if name == "gpt2":
        return tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            n_inner=3 * HIDDEN,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    if name == "bert":
        return tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=2 * HIDDEN,
            max_position_embeddings=32,
            pad_token_id=0,
        )
    if name == "llama":
        return tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
    if name == "qwen2":
        return tf.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            tie_word_embeddings=True,
        )
    if name == "t5":
        return tf.T5Config(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            d_kv=16,
            d_ff=2 * HIDDEN,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
        )
    raise KeyError(name)


def build(name: str, *, seed: int = 0) -> nn.Module:
    """A tiny transformers model with seeded random weights, in train mode."""
    import transformers as tf

    classes = {
        "gpt2": tf.GPT2LMHeadModel,
        "bert": tf.BertForMaskedLM,
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "t5": tf.T5ForConditionalGeneration,
    }
    config = _config(name)
    config._attn_implementation = "eager"  # the same kernels everywhere, no SDPA dispatch choice
    torch.manual_seed(seed)
    model = classes[name](config)
    model.train()
    return model


def batch(name: str, index: int) -> dict[str, torch.Tensor]:
    """Seeded inputs with labels for one micro-batch (plain tensors, made outside any scope)."""
    generator = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -2:] = 0  # some padding, so attention masks matter
    if name == "t5":
        labels = torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=generator)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if name == "bert":
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]
        masked = ids.clone()
        masked[:, ::3] = 4  # the "[MASK]" id
        return {"input_ids": masked, "attention_mask": mask, "labels": labels}
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def prompt(name: str) -> dict[str, torch.Tensor]:
    """A seeded prompt for ``generate()``: two rows, the second left-padded (causal LMs)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (BATCH, 5), generator=generator)
    mask = torch.ones_like(ids)
    if name in CAUSAL_LMS:
        ids[1, :2] = 0
        mask[1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ----------------------------------------------------------------------------- small MLP


def mlp(
    *, batchnorm: bool = False, seed: int = 0, width: int = 32, depth: int = 12
) -> nn.Sequential:
    """A small seeded MLP (optionally with BatchNorm, which has buffers).

    ``depth`` equal hidden layers keep the largest parameter small next to the total, so that a
    residency budget of 40% of the parameters holds one AdamW op.
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(width))
    layers.append(nn.GELU())
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers)


def mlp_batches(n: int, *, rows: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 16, generator=generator), torch.randn(rows, 4, generator=generator))
        for _ in range(n)
    ]


# ----------------------------------------------------------------------------- modes


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def budget_for(*models: nn.Module, fraction: float = BUDGET_FRACTION) -> int:
    """``fraction`` of the parameters' total size, raised to 4x the largest parameter if less.

    One AdamW op (``param.addcdiv_(exp_avg, denom)``) needs three parameter-sized tensors on the
    device at once; 4x leaves room for a gradient. The result is always well below the total
    (GPT-2's fused ``c_attn`` makes its budget 53% of the total; the others are at 40%).
    """
    total = sum(param_bytes(m) for m in models)
    largest = max(p.numel() * p.element_size() for m in models for p in m.parameters())
    budget = max(int(total * fraction), 4 * largest)
    assert budget <= 0.6 * total, f"test setup: budget {budget} B is not below the total {total} B"
    return budget


# Handles of models managed by ``Run.manage``: kept alive until the test's teardown removes them
# (conftest.py), so that a test's residency state is cleaned up by ``handle.remove()`` whether or
# not the test kept its own reference. (Dropping a handle is covered on its own, in
# test_residency_lifecycle.py.)
LIVE_HANDLES: list[ts.ManagedModule] = []


def remove_live_handles() -> None:
    while LIVE_HANDLES:
        LIVE_HANDLES.pop().remove()


@dataclass
class Run:
    """How a test runs its client code: ``plain``, ``scope``, ``flow`` or ``genoa``."""

    mode: str
    budget: int | None = None
    handles: list[ts.ManagedModule] | None = None

    @property
    def managed(self) -> bool:
        return self.mode in RESIDENCY_MODES

    def manage(self, *models: nn.Module, fraction: float = BUDGET_FRACTION) -> None:
        """In the residency modes: configure a budget below the models' size and manage them."""
        if not self.managed:
            return
        self.budget = budget_for(*models, fraction=fraction)
        ts.residency.configure(device="cpu", policy=self.mode, budget=self.budget)
        ts.residency.report(reset=True)
        self.handles = [ts.manage(m) for m in models]
        LIVE_HANDLES.extend(self.handles)

    def step(self) -> contextlib.AbstractContextManager[object]:
        """What wraps each step or call: a scope except in the plain run."""
        return contextlib.nullcontext() if self.mode == "plain" else ts.scope()

    def check_budget(self) -> None:
        """In the residency modes: the peak stayed within the budget, and data did move (the
        budget really was below what the run needed)."""
        if self.managed:
            report = ts.residency.report()
            assert self.budget is not None
            assert report.peak_bytes <= self.budget, f"peak {report.peak_bytes} > {self.budget}"
            assert report.transfers.count > 0, "nothing moved: the budget did not bind"


# ----------------------------------------------------------------------------- checks


def assert_alive(t: torch.Tensor, what: str = "") -> None:
    """Not disposed, and readable."""
    assert not getattr(t, "is_disposed", False), f"{what} was disposed"
    t.detach().sum().item()  # raises if the data is gone


def assert_module_alive(model: nn.Module) -> None:
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        assert_alive(t, name)


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain copies of parameters and buffers (taken outside scopes)."""
    assert ts.current_scope() is None
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def assert_same_state(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    """Every parameter and buffer alive and bit-identical to ``expected``."""
    assert_module_alive(model)
    state = model.state_dict(keep_vars=True)
    assert list(state) == list(expected)
    for key, value in state.items():
        assert value.dtype == expected[key].dtype, key
        assert torch.equal(value.detach(), expected[key]), key


def plain_copy(t: torch.Tensor) -> torch.Tensor:
    """A plain, unowned copy of ``t`` that survives the current scope."""
    out = t.detach().clone()
    if isinstance(out, ts.TensorRef):
        out.detach_from_scope()
    return out


# ----------------------------------------------------------------------------- HF training


def hf_train(
    name: str,
    run: Run,
    *,
    steps: int = 3,
    accumulate: int = 2,
    checkpointing: bool = False,
    autocast: str | None = None,
    model: nn.Module | None = None,
    clip: bool = True,
) -> tuple[nn.Module, list[float]]:
    """AdamW + clip_grad_norm_ + linear warmup schedule + gradient accumulation.

    ``checkpointing``: HF gradient checkpointing (``gradient_checkpointing_enable()``).
    ``clip=False`` leaves out ``clip_grad_norm_`` (to tell its failures from the rest).
    ``autocast``: None, "inside" (a bf16 autocast opened inside each step) or "around" (opened
    once around the whole loop of steps).
    """
    from transformers import get_linear_schedule_with_warmup

    model = build(name) if model is None else model
    if checkpointing:
        with warnings.catch_warnings():  # transformers 5 renames it activation_checkpointing_*
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    run.manage(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, 1, steps * 2)
    torch.manual_seed(123)  # dropout
    losses: list[float] = []

    def autocast_ctx() -> contextlib.AbstractContextManager[object]:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    outer = autocast_ctx() if autocast == "around" else contextlib.nullcontext()
    with outer:
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            for micro in range(accumulate):
                with run.step():
                    inner = autocast_ctx() if autocast == "inside" else contextlib.nullcontext()
                    with inner:
                        loss = model(**batch(name, step * accumulate + micro)).loss / accumulate
                    loss.backward()
                    losses.append(loss.item())
            with run.step():
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
    run.check_budget()
    return model, losses


# ----------------------------------------------------------------------------- generation


def generate_ids(
    model: nn.Module, name: str, decoding: str, run: Run, *, new_tokens: int = 7
) -> list[list[int]]:
    """``generate()`` with KV cache; greedy, beam search (2 beams) or seeded sampling."""
    kwargs: dict[str, object] = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "use_cache": True,
        "pad_token_id": 0,
    }
    if decoding == "greedy":
        kwargs["do_sample"] = False
    elif decoding == "beam":
        kwargs.update(do_sample=False, num_beams=2)
    elif decoding == "sample":
        kwargs.update(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    else:
        raise KeyError(decoding)
    torch.manual_seed(99)
    with run.step():
        out = model.generate(**prompt(name), **kwargs)
        ids = out.tolist()
    return ids


# ----------------------------------------------------------------------------- MLP training


def mlp_train(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    step: Callable[[], contextlib.AbstractContextManager[object]],
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[float]:
    """Adam, one step per batch, each in ``step()``."""
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        with step():
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses
