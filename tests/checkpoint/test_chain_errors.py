"""Block chains: what is refused, with which error, and that nothing is left half done."""

from __future__ import annotations

import warnings

import pytest
import torch
from chain_helpers import MLPChain, hf_step, mlp_step, same_state, tiny_hf, twins
from torch import nn

from tensorscope.checkpoint import Checkpointable, checkpoint_chain, min_memory
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError, ScheduleError

pytestmark = pytest.mark.engine_independent  # rotor runs plain torch ops (checked)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_kv_cache_in_training_is_dropped_as_hf_checkpointing_does(name: str) -> None:
    # GPT-2 passes its cache positionally, Llama by keyword; with config.use_cache on (the
    # default of every HF config) both pass one in train() mode too. The reference trains
    # without a cache, as HF's checkpointing would (GPT-2's attention rounds differently
    # through its cache: gradients 1 ulp apart).
    model, ref = twins(tiny_hf(name))
    model.config.use_cache = True
    with checkpoint_chain(model):
        for step in range(3):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got = hf_step(model)
            said = [str(w.message) for w in seen if "KV cache" in str(w.message)]
            assert len(said) == (1 if step == 0 else 0), said  # once per chain
            assert torch.equal(got, hf_step(ref))
            assert same_state(model, ref) == []


def test_a_cache_holding_tokens_is_refused_not_dropped() -> None:
    # A prefix the blocks attend to changes the results: dropping it would be silent.
    from transformers import DynamicCache

    model = tiny_hf("llama")
    model.train()
    with torch.no_grad():
        prefix = model(input_ids=torch.ones(4, 3, dtype=torch.long), use_cache=True)
    cache = prefix.past_key_values
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 3
    with checkpoint_chain(model), pytest.raises(InvalidArgumentError, match="KV cache"):
        model(input_ids=torch.ones(4, 5, dtype=torch.long), past_key_values=cache)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers renames the method
def test_hf_gradient_checkpointing_is_refused() -> None:
    model = tiny_hf("gpt2")
    model.train()
    model.gradient_checkpointing_enable()
    with checkpoint_chain(model), pytest.raises(InvalidArgumentError, match="disable"):
        hf_step(model)


def test_a_limit_below_the_least_raises_at_the_next_forward_after_a_complete_step() -> None:
    torch.manual_seed(0)
    model, ref = twins(MLPChain())
    with checkpoint_chain(model, mem_limit="1KiB") as chained:
        assert torch.equal(mlp_step(model), mlp_step(ref))  # the measuring step completes
        assert same_state(model, ref) == []
        least = min_memory(chained.chain()) + chained.reserved_nbytes
        with pytest.raises(
            ScheduleError, match=rf"smallest limit that fits is .* \({least} bytes\)"
        ):
            mlp_step(model)
        assert "not measured yet" not in chained.explain()
        chained.compute_sequence(least)  # a limit that fits: training goes on
        model.zero_grad()
        ref.zero_grad()
        assert torch.equal(mlp_step(model), mlp_step(ref))
        assert same_state(model, ref) == []


class Tweaked(MLPChain):
    """Changes the hidden state between blocks: not a chain the schedule can recompute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)[0] * 1.0
        return self.head(h)


class Skipping(MLPChain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers[1:]:
            h = layer(h)[0]
        return self.head(h)


class ByKeyword(MLPChain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers[0](x=self.embed(x))[0])


@pytest.mark.parametrize(
    ("cls", "error", "match"),
    [
        (Tweaked, InvalidArgumentError, "did not get block 0's output"),
        (Skipping, InvalidArgumentError, "block 1 of layers was called before block 0"),
        (ByKeyword, ArgumentTypeError, "Pass it positionally"),
    ],
)
def test_models_that_do_not_chain_their_blocks(
    cls: type[MLPChain], error: type[Exception], match: str
) -> None:
    model = cls()
    model.train()
    with checkpoint_chain(model), pytest.raises(error, match=match):
        mlp_step(model)
    mlp_step(model)  # removed: the model is its plain self again


def test_bad_chains_and_arguments() -> None:
    block = nn.Linear(4, 4)
    with pytest.raises(InvalidArgumentError, match="same module as block 0"):
        checkpoint_chain(nn.ModuleList([block, block]))
    with pytest.raises(
        InvalidArgumentError, match=r"no block chain.*checkpoint_chain\(model\.blocks"
    ):
        checkpoint_chain(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), mem_limit="1MiB")
    model = MLPChain()
    with pytest.raises(InvalidArgumentError, match="mem_limit"):
        checkpoint_chain(model, mem_limit="12 parsecs")
    with pytest.raises(InvalidArgumentError, match="slots"):
        checkpoint_chain(model, slots=0)
    with checkpoint_chain(model), pytest.raises(InvalidArgumentError, match="already routed"):
        checkpoint_chain(model)
    with checkpoint_chain(model) as chained:  # removed: it can be installed again
        assert chained.compute_sequence("1MiB") is None  # nothing measured yet
        with pytest.raises(InvalidArgumentError, match="run one training step"):
            chained.chain()
    with pytest.raises(ArgumentTypeError, match="checkpoint_chain"):
        Checkpointable(model.layers)  # a ModuleList is not a Sequential


def test_integer_hidden_state_and_second_backward() -> None:
    class Count(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return ids + 1

    blocks = nn.ModuleList([Count(), Count()])
    with checkpoint_chain(blocks), pytest.raises(ArgumentTypeError, match="floating-point"):
        blocks[0](torch.zeros(2, dtype=torch.long))
    model = MLPChain()
    model.train()
    with checkpoint_chain(model):
        loss = model(torch.randn(4, 32)).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(InvalidArgumentError, match="a second backward"):
            loss.backward()


def test_explain_names_the_blocks_and_the_choice() -> None:
    model = tiny_hf("bert")
    model.train()
    with checkpoint_chain(model) as chained:
        hf_step(model)
        chained.compute_sequence(min_memory(chained.chain()) + chained.reserved_nbytes)
        text = chained.explain()
    assert text.startswith("CheckpointedChain: 4 blocks, mem_limit ")
    assert "BertLayer" in text and "recomputed" in text
    assert "the context every block shares" in text
