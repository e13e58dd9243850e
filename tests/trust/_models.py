"""Tiny, seeded models and data for the trust tests (nothing is downloaded).

transformers models are built from tiny configs (2 layers, hidden 32, vocab 128) with random
weights; the same name and seed always give the same weights, so a plain run and a run under
tensorscope start from identical models.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import torch
from torch import nn

import tensorscope as ts

VOCAB = 128


def mlp(
    *, seed: int = 0, width: int = 32, depth: int = 8, batchnorm: bool = False
) -> nn.Sequential:
    """A seeded MLP of ``depth`` equal hidden layers (the largest parameter is small next to the
    total, so a budget of 40% of the parameters still holds one Adam op)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(width))
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers)


def mlp_batches(n: int, *, seed: int = 1, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 16, generator=generator), torch.randn(rows, 4, generator=generator))
        for _ in range(n)
    ]


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def budget_for(*models: nn.Module, fraction: float = 0.4) -> int:
    """``fraction`` of the parameters' size, at least 5x the largest parameter (one Adam op)."""
    total = sum(param_bytes(m) for m in models)
    largest = max(p.numel() * p.element_size() for m in models for p in m.parameters())
    budget = max(int(total * fraction), 5 * largest)
    assert budget < total, f"test setup: budget {budget} B is not below the total {total} B"
    return budget


def manage_under_budget(
    *models: nn.Module, policy: str = "flow"
) -> tuple[int, list[ts.ManagedModule]]:
    """Configure a budget below the models' size, manage them; (budget, handles)."""
    budget = budget_for(*models)
    ts.residency.configure(device="cpu", policy=policy, budget=budget)
    ts.residency.report(reset=True)
    return budget, [ts.manage(m) for m in models]


def train_mlp(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    scoped: bool,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[float]:
    """Adam (unless given), one step per batch, each in a scope when ``scoped``."""
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        with ts.scope() if scoped else contextlib.nullcontext():
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain copies of parameters and buffers (taken outside scopes)."""
    assert ts.current_scope() is None
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def assert_same_state(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    """Every parameter and buffer alive and bit-identical to ``expected``."""
    state = model.state_dict(keep_vars=True)
    assert list(state) == list(expected)
    for key, value in state.items():
        assert not isinstance(value, ts.DisposedTensor), f"{key} was disposed"
        assert value.dtype == expected[key].dtype, key
        assert torch.equal(value.detach(), expected[key]), key


def plain_copy(t: torch.Tensor) -> torch.Tensor:
    """A plain, unowned copy of ``t`` that survives the current scope."""
    out = t.detach().clone()
    if isinstance(out, ts.TensorRef):
        out.detach_from_scope()
    return out


# ----------------------------------------------------------------------------- transformers


def tiny_config(name: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if name == "llama":
        return tf.LlamaConfig(**common)
    if name == "qwen2":
        return tf.Qwen2Config(**common)
    if name == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    raise KeyError(name)


def tiny_lm(name: str = "llama", *, seed: int = 0) -> nn.Module:
    """A tiny rotary causal LM (``llama``, ``qwen2`` or ``mistral``), seeded random weights."""
    import transformers as tf

    classes = {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "mistral": tf.MistralForCausalLM,
    }
    config = tiny_config(name)
    config._attn_implementation = "eager"  # the same kernels everywhere
    torch.manual_seed(seed)
    model = classes[name](config)
    model.eval()
    return model


def token_ids(index: int = 0, *, rows: int = 2, length: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + index)
    return torch.randint(3, VOCAB, (rows, length), generator=generator)


# ----------------------------------------------------------------------------- subprocesses


def run_child(
    code: str, *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (for what crashes the process today); ``env`` adds
    to this process's environment."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def describe(done: subprocess.CompletedProcess[str]) -> str:
    """The child's return code and the tail of its output, for assertion messages."""
    return f"rc={done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"
