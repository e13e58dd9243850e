"""``generate()`` under tensorscope gives the same token ids as without it (item 1).

Greedy, beam search (2 beams) and seeded sampling, with the KV cache, 7 new tokens, for the
causal LMs and T5 (seq2seq). Each ``generate()`` call runs in a scope ("scope"), or in a scope on
a model managed under a budget below its size ("flow", "genoa"). Each mode calls ``generate()``
twice: the second call must give the same ids too (nothing the first call needed was disposed).
"""

from __future__ import annotations

import functools

import pytest

from . import _models as M

DECODINGS = ("greedy", "beam", "sample")


@functools.cache
def _plain(name: str, decoding: str) -> list[list[int]]:
    model = M.build(name).eval()
    return M.generate_ids(model, name, decoding, M.Run("plain"))


@pytest.mark.parametrize("mode", M.MODES)
@pytest.mark.parametrize("decoding", DECODINGS)
@pytest.mark.parametrize("name", M.GENERATIVE)
def test_generate_matches_plain(name: str, decoding: str, mode: str) -> None:
    expected = _plain(name, decoding)
    assert len(expected[0]) >= 7
    model = M.build(name).eval()
    run = M.Run(mode)
    run.manage(model)
    first = M.generate_ids(model, name, decoding, run)
    second = M.generate_ids(model, name, decoding, run)
    assert first == expected
    assert second == expected
    M.assert_module_alive(model)
    run.check_budget()


def test_sampling_depends_on_the_seed() -> None:
    """The sampled comparison is meaningful: the plain run is not greedy in disguise."""
    assert _plain("gpt2", "sample") != _plain("gpt2", "greedy")
