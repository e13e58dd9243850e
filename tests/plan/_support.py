"""Models, steps and independent measurements shared by the plan tests.

Every transformers model is built from a tiny config with random weights (nothing is
downloaded); builders are seeded, so two builds are identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tensorscope.check.measure import profiler_peak

VOCAB = 128


def build(name: str, *, seed: int = 0, layers: int = 2, hidden: int = 64) -> nn.Module:
    """A tiny transformers model (``gpt2``, ``llama``, ``bert``) in train mode, eager attention."""
    import transformers as tf

    torch.manual_seed(seed)
    if name == "gpt2":
        config: Any = tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=128,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_inner=3 * hidden,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        cls: Any = tf.GPT2LMHeadModel
    elif name == "llama":
        config = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
        cls = tf.LlamaForCausalLM
    elif name == "bert":
        config = tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=2 * hidden,
            max_position_embeddings=128,
            pad_token_id=0,
        )
        cls = tf.BertForMaskedLM
    else:
        raise KeyError(name)
    config._attn_implementation = "eager"
    model: nn.Module = cls(config)
    model.train()
    return model


BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer"}


def batch(*, rows: int = 2, seq: int = 8, seed: int = 1) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=generator)
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def mlp(seed: int = 0, width: int = 256) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8)
    )


def mlp_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 1) -> Callable[[], None]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=generator)
    y = torch.randn(32, 8, generator=generator)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def hf_step(model: nn.Module, opt: torch.optim.Optimizer, **shape: int) -> Callable[[], None]:
    inputs = batch(**shape)
    if getattr(model.config, "model_type", "") == "bert":
        del inputs["use_cache"]  # an encoder: no cache to turn off

    def step() -> None:
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages of ``tensors`` (a view or a tied weight counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def allocator_peak(step: Callable[[], None]) -> int:
    """The highest bytes the CPU allocator held above what it held when ``step`` began, as
    torch's profiler (``profile_memory=True``) reports them: an independent reference."""
    return profiler_peak(step)
