"""Creation sites: the file:line of the user code that created a tensor.

Captured for every ref on the hot path, so it must be cheap: walk Python frames outward from the
op and stop at the first frame whose file is not part of torch or tensorscope. The library/user
verdict is cached per file name (strings hash once), so a step costs one dict lookup per frame.
Ops run by the autograd engine from C++ have only the frames of the code that called
``backward()``, which is the right answer for tensors created in backward.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import TypeAlias

import torch

__all__ = ["Site", "capture_site", "format_site"]

Site: TypeAlias = "tuple[str, int] | None"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, _PACKAGE_DIR)
# The demo plays the part of user code: its sites are what a user would see.
_USER_FILES = {_PACKAGE_DIR + "demo.py"}
_is_library: dict[str, bool] = {}


def _classify(filename: str) -> bool:
    verdict = (
        filename.startswith(_LIBRARY_DIRS) or filename.startswith("<frozen")
    ) and filename not in _USER_FILES
    _is_library[filename] = verdict
    return verdict


def capture_site(skip: int = 1) -> Site:
    """Return ``(filename, lineno)`` of the innermost user frame, skipping ``skip`` frames."""
    frame: FrameType | None = sys._getframe(skip + 1)
    lookup = _is_library.get
    while frame is not None:
        filename = frame.f_code.co_filename
        verdict = lookup(filename)
        if verdict is None:
            verdict = _classify(filename)
        if not verdict:
            return (filename, frame.f_lineno)
        frame = frame.f_back
    return None


def format_site(site: Site) -> str:
    """``"train.py:42"`` style text (full path kept when short enough to read)."""
    if site is None:
        return "an unknown site (no user frame: created by torch internals)"
    filename, lineno = site
    return f"{filename}:{lineno}"
