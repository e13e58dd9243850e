"""Test helpers for block chains: tiny models, a plain/checkpointed step, and a meter that counts
the bytes the chain itself holds during a step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tensorscope.checkpoint import blockrun
from tensorscope.checkpoint.tracker import StorageTracker

VOCAB = 97


class Block(nn.Module):
    """A residual MLP block with dropout and BatchNorm; optional context arguments."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)
        self.norm = nn.BatchNorm1d(width)

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        scale: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.down(nn.functional.gelu(self.up(x)))
        if scale is not None:
            h = h * scale[0] + scale[1]
        if bias is not None:
            h = h + bias
        out = self.norm(x + self.drop(h))
        return out, h.mean(dim=-1)


class MLPChain(nn.Module):
    """Embedding, a ModuleList of blocks called in a loop (HF style), head."""

    def __init__(self, width: int = 32, depth: int = 6, *, use_extras: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)
        self.use_extras = use_extras
        self.bias: torch.Tensor | None = None  # a context tensor that may require grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        width = h.shape[-1]
        scale = (torch.full((width,), 0.5), torch.zeros(width))  # shared by every block
        side = torch.zeros(())
        for layer in self.layers:
            h, extra = layer(h, self.bias, scale=scale, cache=None)
            side = side + extra.sum()
        out = self.head(h)
        return out + side if self.use_extras else out


def tiny_hf(name: str) -> nn.Module:
    """A tiny transformers model with random weights (dropout on, no KV cache)."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tf.GPT2Config(
            n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False
        )
        return tf.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = tf.LlamaConfig(
            num_hidden_layers=4,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            use_cache=False,
            attention_dropout=0.1,
        )
        return tf.LlamaForCausalLM(cfg)
    if name == "bert":
        cfg = tf.BertConfig(
            num_hidden_layers=4,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            vocab_size=VOCAB,
        )
        return tf.BertForMaskedLM(cfg)
    raise ValueError(name)


def hf_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[0, 11:] = 0  # padding: a real attention mask reaches the blocks
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def hf_step(model: nn.Module) -> torch.Tensor:
    torch.manual_seed(3)
    out = model(**hf_batch())
    out.loss.backward()
    return out.loss.detach()


def mlp_step(model: nn.Module, x: torch.Tensor | None = None) -> torch.Tensor:
    torch.manual_seed(3)
    if x is None:
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def same_state(a: nn.Module, b: nn.Module) -> list[str]:
    """Names of gradients or buffers that differ (bit for bit) between two models."""
    bad = []
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None) or (
            p.grad is not None and not torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        ):
            bad.append(name)
    for (name, x), y in zip(a.named_buffers(), b.buffers(), strict=True):
        if not torch.equal(x, y):
            bad.append(name)
    return bad


def twins(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    model.train()
    return model, copy.deepcopy(model)


class ChainMeter(StorageTracker):
    """Counts only the storages allocated while a chain op runs (a block's forward or
    backward inside the executor); :meth:`chain_peak` replays them without some storages."""

    def __init__(self) -> None:
        super().__init__()
        self.in_chain = 0
        self.chain_serials: set[int] = set()

    def _allocated(self, key: int, storage: torch.UntypedStorage) -> None:
        super()._allocated(key, storage)
        if self.in_chain:
            self.chain_serials.add(self._serial)

    def chain_peak(self, exclude: list[torch.Tensor]) -> int:
        skip = {self._alive[k][0] for k in _keys(exclude) if k in self._alive}
        live = peak = 0
        for serial, delta in self._log:
            if serial in self.chain_serials and serial not in skip:
                live += delta
                peak = max(peak, live)
        return peak


def _keys(tensors: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


@contextmanager
def metered(meter: ChainMeter) -> Iterator[None]:
    """Mark the executor's ops as chain ops for ``meter``."""
    run = blockrun.BlockRun
    forward_op, backward_op = run.forward_op, run._backward_op

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            meter.in_chain += 1
            try:
                return fn(*args, **kwargs)
            finally:
                meter.in_chain -= 1

        return inner

    run.forward_op = wrap(forward_op)  # type: ignore[method-assign]
    run._backward_op = wrap(backward_op)  # type: ignore[method-assign]
    try:
        with meter:
            yield
    finally:
        run.forward_op, run._backward_op = forward_op, backward_op  # type: ignore[method-assign]
        meter.close()
