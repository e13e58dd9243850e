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
