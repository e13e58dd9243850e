"""Messages name the user's own line first, then the library line under it (issue 15 §4).

A tensor made inside a transformers model is created in ``modeling_*.py``; the leak report and
the disposal error used to name only that line. They now name the first frame outside installed
packages (this file) and, after it, the library's.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import tensorscope as ts

from . import _models as M

THIS_FILE = re.escape(__file__)


def test_a_leak_in_a_library_model_names_the_users_line_then_the_library_line() -> None:
    model = M.build("bert").eval()
    kept: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.LeakWarning)
        with ts.scope(report_leaks=True) as s, torch.no_grad():
            kept.append(model(**M.prompt("bert")).logits)  # the user's line
    site = s.leaks[0].site
    assert re.match(rf"{THIS_FILE}:\d+ \(in .*transformers.*modeling_bert\.py:\d+\)$", site), site
    with pytest.raises(ts.DisposedTensorError) as raised:
        kept[0] + 1
    assert re.search(
        rf"created at {THIS_FILE}:\d+ \(in .*modeling_bert\.py:\d+\)", str(raised.value)
    )


def test_a_tensor_made_by_user_code_names_one_line() -> None:
    with ts.scope() as s:
        made_here = torch.ones(2) * 3
        assert s.tracked()
    with pytest.raises(ts.DisposedTensorError, match=rf"created at {THIS_FILE}:\d+, was disposed"):
        made_here + 1


def _made_in_code_with_an_unhashable_constant() -> torch.Tensor:
    return torch.ones(2) * 3


# torch.compile's resume functions (a graph break) carry constants that cannot be hashed; their
# frames were met by the site walk of a scope and of ts.record and raised TypeError.
_made_in_code_with_an_unhashable_constant.__code__ = (
    _made_in_code_with_an_unhashable_constant.__code__.replace(
        co_consts=(*_made_in_code_with_an_unhashable_constant.__code__.co_consts, {})
    )
)


def test_a_frame_whose_code_cannot_be_hashed_is_a_site_like_any_other() -> None:
    with pytest.raises(TypeError):
        hash(_made_in_code_with_an_unhashable_constant.__code__)
    for _ in range(2):  # classified, then from the cache
        with ts.scope():
            made = _made_in_code_with_an_unhashable_constant()
        with pytest.raises(ts.DisposedTensorError, match=rf"created at {THIS_FILE}:\d+"):
            made + 1
    with ts.record() as rec:
        _made_in_code_with_an_unhashable_constant().sum()
    sites = {t.site for t in rec.plan().lifetimes}  # relative to the working directory
    assert any("_made_in_code_with_an_unhashable_constant" in site for site in sites), sites
