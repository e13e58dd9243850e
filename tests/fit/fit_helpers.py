"""Helpers for ts.fit's tests: tiny models (random weights, built from configs), a plain twin,
a training loop, and a recorded plain step to size budgets from."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.checkpoint.offloaded import OffloadModel
from tensorscope.errors import FitWarning, ScheduleError
from tensorscope.fit.decider import Decider

VOCAB = 97
BATCH, SEQ = 4, 32


class Block(nn.Module):
    """A residual MLP block with dropout."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(x))))


class MLPChain(nn.Module):
    """Embedding, a ModuleList of blocks called in a loop (HF style), head."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class ConvBlock(nn.Module):
    """torchvision's ResNet BasicBlock (3x3 conv, BatchNorm, ReLU, twice, plus the input)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


class CNN(nn.Module):
    """A ResNet-style CNN whose blocks are a list (torchvision 0.28, the release for torch 2.13,
    does not load beside it here: its C++ ops do not register): stem, blocks, pooled head."""

    def __init__(self, channels: int = 16, depth: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(depth))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


def gpt2(layers: int, hidden: int, vocab: int, positions: int) -> nn.Module:
    """A GPT-2 of that shape (4 heads, random weights seeded 0, no KV cache), in train()."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        vocab_size=vocab,
        n_positions=positions,
        use_cache=False,
    )
    return tf.GPT2LMHeadModel(cfg).train()


def llama(layers: int, hidden: int, ffn: int, vocab: int, dropout: float = 0.0) -> nn.Module:
    """A Llama of that shape (4 heads over 2 key/value heads, random weights seeded 0, no KV
    cache), in train()."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        use_cache=False,
        attention_dropout=dropout,
    )
    return tf.LlamaForCausalLM(cfg).train()


def tiny(name: str) -> nn.Module:
    """A tiny model with random weights (dropout on, no KV cache), in train() mode."""
    if name == "gpt2":
        return gpt2(4, 32, VOCAB, 64)
    if name == "llama":
        return llama(4, 32, 64, VOCAB, dropout=0.1)
    torch.manual_seed(0)
    if name == "mlp":
        return MLPChain().train()
    if name == "cnn":
        return CNN().train()
    if name == "bert":
        import transformers as tf

        cfg = tf.BertConfig(
            num_hidden_layers=4,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            vocab_size=VOCAB,
        )
        return tf.BertForMaskedLM(cfg).train()
    raise ValueError(name)


BIG_VOCAB = 4096  # 4 x 32 tokens x 4096 x 4 bytes = 2 MiB of logits: ts.fit routes the loss


def big_vocabulary(name: str) -> nn.Module:
    """A 2-layer GPT-2 or Llama with a BIG_VOCAB vocabulary (random weights), in train() mode."""
    if name == "gpt2":
        return gpt2(2, 32, BIG_VOCAB, 64)
    return llama(2, 32, 64, BIG_VOCAB)


def offload_for_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """ts.fit's offload model with no I/O time: the decision offloads wherever it fits (what
    runs is tested, whatever this machine's bandwidth)."""
    measured = Decider.offload_model

    def free(self: Decider) -> OffloadModel | None:
        model = measured(self)
        return None if model is None else OffloadModel(model.nbytes, (0.0,) * len(model.nbytes))

    monkeypatch.setattr(Decider, "offload_model", free)


def batches(name: str, seq: int = SEQ) -> Iterator[dict[str, torch.Tensor]]:
    """The same endless stream of batches for a model and its twin."""
    g = torch.Generator().manual_seed(1)
    while True:
        if name == "mlp":
            yield {"x": torch.randn(12 * seq, 16, generator=g)}
            continue
        if name == "cnn":
            images = torch.randn(BATCH * 2, 3, seq // 2, seq // 2, generator=g)
            yield {"image": images, "label": torch.randint(0, 10, (BATCH * 2,), generator=g)}
            continue
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
        mask = torch.ones(BATCH, seq, dtype=torch.long)
        mask[0, seq - 5 :] = 0  # padding: a real attention mask reaches the blocks
        yield {"input_ids": ids, "attention_mask": mask, "labels": ids}


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "x" in batch:
        return model(batch["x"]).square().mean()
    if "image" in batch:
        return nn.functional.cross_entropy(model(batch["image"]), batch["label"])
    return model(**batch).loss  # type: ignore[no-any-return]


def optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    raise ValueError(kind)


def step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    *,
    clip: float | None = None,
    scoped: bool = False,
    seed: int = 0,
) -> float:
    """One plain training step (the user's loop, unchanged); returns the loss."""
    torch.manual_seed(seed)
    with ts.scope() if scoped else contextlib.nullcontext():
        loss = loss_of(model, batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return float(loss.item())


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def differing(a: nn.Module, b: nn.Module) -> list[str]:
    """Names of parameters or buffers that are not bit-identical."""
    bad = [
        n
        for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True)
        if not torch.equal(p, q)
    ]
    bad += [
        n for (n, x), y in zip(a.named_buffers(), b.buffers(), strict=True) if not torch.equal(x, y)
    ]
    return bad


def plain_peak(name: str, kind: str, seq: int = SEQ) -> int:
    """The recorded peak of a plain steady step (the second) of a fresh model."""
    model = tiny(name)
    opt = optimizer(kind, model)
    data = batches(name, seq)
    step(model, opt, next(data))
    with ts.record() as rec:
        step(model, opt, next(data))
    return rec.plan().peak_bytes


def tight_state_budget(name: str, kind: str, clip: float | None) -> int:
    """A budget between the smallest plan with the optimizer state offloaded and the smallest
    with it resident (read from a first fit's candidates)."""
    model = tiny(name)
    opt = optimizer(kind, model)
    fit = ts.fit(model, opt, budget="1GiB")
    data = batches(name)
    step(model, opt, next(data), clip=clip)
    assert fit.decision is not None
    resident = min(c.least_budget for c in fit.decision.candidates if not c.base.state_offloaded)
    moved = min(c.least_budget for c in fit.decision.candidates if c.base.state_offloaded)
    fit.remove()
    assert moved < resident
    return (moved + resident) // 2


# A GPT-2 4 x 128 (vocabulary 256, batches 4 x 64) at the least budget ts.fit reaches: the tests
# of the chain's parameters in files and of blocks kept selectively.
LEAST_VOCAB, LEAST_BATCH, LEAST_SEQ = 256, 4, 64


def least_gpt2() -> nn.Module:
    """The GPT-2 4 x 128 of the least-budget tests (random weights seeded 0, train())."""
    return gpt2(4, 128, LEAST_VOCAB, LEAST_SEQ)


def least_batches(n: int) -> list[torch.Tensor]:
    """``n`` batches of token ids for :func:`least_gpt2` (seeded)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, LEAST_VOCAB, (LEAST_BATCH, LEAST_SEQ), generator=g) for _ in range(n)]


def seeded_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, k: int) -> float:
    """One training step of a causal LM on ``ids``, the random state seeded ``k`` (dropout: two
    models stepped alike draw the same masks)."""
    torch.manual_seed(k)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def least_budget(monkeypatch: pytest.MonkeyPatch | None) -> int:
    """The smallest budget ts.fit reaches for :func:`least_gpt2` (with the chain's parameters
    placed in files allowed, or not: ``monkeypatch``, undone before returning), read from the
    ScheduleError of a 1 MiB budget."""
    model = least_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=1 << 20)
    try:
        if monkeypatch is not None:
            monkeypatch.setattr(Decider, "_can_place", lambda self, free: False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FitWarning)
            with pytest.raises(ScheduleError) as info:
                seeded_step(model, opt, least_batches(1)[0], 0)
    finally:
        fit.remove()
        if monkeypatch is not None:
            monkeypatch.undo()
    assert fit.decision is None
    text = str(info.value)
    return int(text.split("the smallest budget that fits is ")[1].split("(")[1].split(" ")[0])
