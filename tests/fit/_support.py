"""Seeded tiny models for the offload tests: an MLP of blocks, transformers GPT-2 and Llama
built from configs with random weights (nothing downloaded)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from tensorscope.fit.offload import ActivationOffloader

VOCAB = 128
HIDDEN = 64


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        self.inner_checkpoint = False  # run ``up`` under torch.utils.checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.inner_checkpoint:
            up: torch.Tensor = torch_checkpoint.checkpoint(self.up, h, use_reentrant=False)
        else:
            up = self.up(h)
        return x + self.down(torch.tanh(up))


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x).square().mean()
        return out


def mlp(width: int = 32, depth: int = 4, seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(width, depth)


def mlp_input(rows: int = 16, width: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


def hf_model(name: str, seed: int = 0) -> nn.Module:
    import transformers as tf

    if name == "gpt2":
        config: Any = tf.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=3, n_head=4
        )
        cls: Any = tf.GPT2LMHeadModel
    else:
        config = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
        cls = tf.LlamaForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model: nn.Module = cls(config)
    model.train()
    return model


def blocks_of(model: nn.Module) -> nn.ModuleList:
    inner: Any = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    blocks: nn.ModuleList = inner
    return blocks


def hf_input(seed: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def released(offloader: ActivationOffloader) -> bool:
    """Whether every offloaded activation was given back (graphs collected, jobs done)."""
    gc.collect()
    offloader.sync()
    stats = offloader.stats()
    return stats.live_entries == 0 and stats.tier_bytes == 0 and stats.ram_bytes == 0


def run_plain(model: nn.Module, step: Callable[[], torch.Tensor]) -> tuple[float, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    loss = step()
    loss.backward()
    return loss.item(), grads(model)
