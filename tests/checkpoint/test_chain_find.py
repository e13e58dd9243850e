"""Finding a model's block chain: the rule on plain data, then on real transformers models."""

from __future__ import annotations

import pytest
from chain_helpers import MLPChain, tiny_hf
from torch import nn

from tensorscope.checkpoint import find_chain, pick_chain
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError

pytestmark = pytest.mark.engine_independent  # rotor runs plain torch ops (checked)


def test_longest_list_of_one_class_wins() -> None:
    lists = [
        ("encoder.layers", ["Layer"] * 6),
        ("decoder.layers", ["Layer"] * 3),
        ("heads", ["Linear"] * 9 + ["Conv"]),  # mixed classes: not a chain
        ("single", ["Layer"]),  # one block: not a chain
    ]
    assert pick_chain(lists) == "encoder.layers"


def test_lists_inside_a_chains_blocks_are_not_chains() -> None:
    # a mixture-of-experts layer per block: 8 experts side by side in each of 2 blocks
    lists = [("model.layers", ["MoELayer"] * 2)] + [
        (f"model.layers.{i}.mlp.experts", ["Expert"] * 8) for i in range(2)
    ]
    assert pick_chain(lists) == "model.layers"


def test_the_root_list_and_prefixes_that_are_not_parents() -> None:
    assert pick_chain([("", ["Block"] * 3)]) == ""
    # "layers2" is not inside "layers": both count
    assert pick_chain([("layers", ["A"] * 2), ("layers2", ["B"] * 3)]) == "layers2"


def test_no_chain_and_ties_say_what_to_do() -> None:
    with pytest.raises(InvalidArgumentError, match=r"no block chain.*heads \(2\).*blocks="):
        pick_chain([("heads", ["Linear", "Conv"])])
    with pytest.raises(InvalidArgumentError, match="module lists found: none"):
        pick_chain([])
    with pytest.raises(InvalidArgumentError, match=r"2 block chains of 4 blocks: a, b.*blocks='a'"):
        pick_chain([("a", ["X"] * 4), ("b", ["Y"] * 4)])


@pytest.mark.parametrize(
    ("name", "path", "blocks"),
    [
        ("gpt2", "transformer.h", "GPT2Block"),
        ("llama", "model.layers", "LlamaDecoderLayer"),
        ("bert", "bert.encoder.layer", "BertLayer"),
    ],
)
def test_transformers_models(name: str, path: str, blocks: str) -> None:
    found_path, chain = find_chain(tiny_hf(name))
    assert found_path == path
    assert len(chain) == 4 and type(chain[0]).__name__ == blocks


def test_t5_has_two_chains_and_blocks_picks_one() -> None:
    import transformers as tf

    cfg = tf.T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2, use_cache=False
    )
    model = tf.T5ForConditionalGeneration(cfg)
    with pytest.raises(InvalidArgumentError, match=r"encoder\.block, decoder\.block"):
        find_chain(model)
    path, chain = find_chain(model, "decoder.block")
    assert path == "decoder.block" and chain is model.decoder.block


def test_a_module_list_is_its_own_chain_and_bad_paths_are_refused() -> None:
    model = MLPChain(depth=3)
    assert find_chain(model.layers) == ("", model.layers)
    assert find_chain(model)[0] == "layers"
    with pytest.raises(InvalidArgumentError, match="names no submodule"):
        find_chain(model, "layerz")
    with pytest.raises(ArgumentTypeError, match=r"is a Linear, not an nn\.ModuleList"):
        find_chain(model, "head")
    with pytest.raises(ArgumentTypeError, match=r"expected an nn\.Module"):
        find_chain([nn.Linear(2, 2)])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="no block chain"):
        find_chain(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
