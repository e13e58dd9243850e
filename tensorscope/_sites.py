"""Creation sites, and the torch code whose tensors are long-lived state (never owned).

A ref remembers where user code created it: the first frame, walking outward from the op, whose
file is not part of torch or tensorscope. When that frame belongs to an installed package (a
transformers model's ``modeling_bert.py``), the walk goes on to the user's own frame, the first
outside installed packages (``train.py:42``), and the ref remembers both: messages name the
user's line and the library line under it. The walk is on the hot path, so it keeps only code
objects and instruction offsets (``f_lasti``); the file:line text is computed when an error or
a leak report needs it. Each code object's verdict (user, package, library, state maker) is
cached, so a frame costs one dict lookup.

# NOTE [state makers]
# Some torch code creates tensors that torch or a module keeps as its own long-lived state:
# ``Module._apply`` (``model.to(dtype)``, ``.half()``: new buffers assigned behind the buffer
# registration hook), ``Tensor.__deepcopy__`` (a copy made to be kept; torch requires it to keep
# the original's plain type), ``state_dict()`` of modules and optimizers (aliases of their
# state), a GradScaler's lazily created scale, ``Optimizer.load_state_dict`` (optimizer state),
# tensors a DataLoader receives from its workers (parked in its reorder buffer across steps),
# what torch.compile's machinery makes while compiling, and the internals of tensor subclasses
# and distributed training (a jagged nested tensor's components, DDP's buckets, FSDP's shards).
# A scope must never own those: if the walk meets one of these frames before the first user
# frame, the result is not owned.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Any, Final, TypeAlias

import torch

from tensorscope._engine import FAST

__all__ = [
    "NOT_OWNED",
    "NotOwned",
    "Site",
    "caller_site",
    "capture_site",
    "format_site",
    "mark_state_maker",
    "site_file_line",
    "site_verdicts",
    "user_file_line",
    "user_site",
]

# (code object of the innermost user or package frame, its f_lasti), followed, when that frame
# is in an installed package, by the user's own frame outside packages (code object, f_lasti)
# if there is one; or None when no such frame was found.
Site: TypeAlias = "tuple[CodeType, int] | tuple[CodeType, int, CodeType, int] | None"


class NotOwned:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_OWNED"


NOT_OWNED: Final = NotOwned()

_USER, _LIBRARY, _STATE_MAKER, _PACKAGE = 0, 1, 2, 3
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_LIBRARY_DIRS = (_TORCH_DIR, _PACKAGE_DIR)
# The demo plays the part of user code: its sites are what a user would see.
_USER_FILES = {_PACKAGE_DIR + "demo.py"}
# Where pip installs packages: code there is a library the user called (transformers), not the
# user's own.
_INSTALLED_DIRS = tuple(
    sorted(
        {
            os.path.join(os.path.abspath(path), "")
            for path in (
                *site.getsitepackages(),
                site.getusersitepackages(),
                sysconfig.get_paths()["purelib"],
                sysconfig.get_paths()["platlib"],
            )
        }
    )
)
# Whole files and directories whose tensors are state (see the NOTE above).
_STATE_MAKER_PATHS = tuple(
    _TORCH_DIR + path.replace("/", os.sep)
    for path in (
        "multiprocessing/reductions.py",
        "_dynamo/",
        "_inductor/",
        # The parts of tensor subclasses and of distributed training: a jagged nested tensor's
        # values, offsets and cached lengths, DTensor's local shards, FSDP's unsharded
        # parameters, DDP's gradient buckets (rebuilt in the second forward) are theirs.
        "nested/_internal/",
        "distributed/",
        "nn/parallel/distributed.py",
        # A checkpoint's RNG states and recomputation bookkeeping are its graph's.
        "utils/checkpoint.py",
    )
)


def _state_maker_codes() -> set[CodeType]:
    from torch.amp.grad_scaler import GradScaler

    functions: list[Any] = [
        torch.nn.Module._apply,
        torch.nn.Module.state_dict,
        torch.Tensor.__deepcopy__,
        GradScaler._lazy_init_scale_growth_tracker,
        torch.optim.Optimizer.load_state_dict,
        torch.optim.Optimizer.state_dict,
    ]
    codes = set()
    for function in functions:
        code = getattr(getattr(function, "__wrapped__", function), "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


# Every code object classified so far, with its verdict; it keeps them alive, so their ids stay
# theirs. ``_by_id`` is what the walk reads: hashing a code object hashes its constants, names
# and bytecode every time (CPython does not cache it), an id costs nothing.
_verdicts: dict[CodeType, int] = dict.fromkeys(_state_maker_codes(), _STATE_MAKER)
_by_id: dict[int, int] = {id(code): verdict for code, verdict in _verdicts.items()}
_unhashable: list[CodeType] = []


def mark_state_maker(function: Any) -> None:
    """Add a function of tensorscope's own to the state makers (see the NOTE above)."""
    code = function.__code__
    _verdicts[code] = _by_id[id(code)] = _STATE_MAKER
    if FAST is not None:
        FAST.forget_verdicts()


def _classify(code: CodeType) -> int:
    filename = code.co_filename
    if filename.startswith(_STATE_MAKER_PATHS):
        verdict = _STATE_MAKER
    elif (
        filename.startswith(_LIBRARY_DIRS) or filename.startswith("<frozen")
    ) and filename not in _USER_FILES:
        verdict = _LIBRARY
    elif filename.startswith(_INSTALLED_DIRS):
        verdict = _PACKAGE
    else:
        verdict = _USER
    _by_id[id(code)] = verdict
    try:
        _verdicts[code] = verdict
    except TypeError:  # a constant that cannot be hashed (torch.compile's resume functions)
        _unhashable.append(code)  # kept alive all the same: its id stays its own
    return verdict


def site_verdicts() -> tuple[dict[CodeType, int], Any]:
    """The verdict cache and the classifier, for the C++ engine's own walk (csrc/fast.cpp)."""
    return _verdicts, _classify


def capture_site(skip: int = 1, *, through_state_makers: bool = False) -> Site | NotOwned:
    """The innermost user frame's site, skipping ``skip`` frames; ``NOT_OWNED`` when a state
    maker (see the NOTE above) called the op, unless ``through_state_makers``: then state makers
    are walked past like any torch frame."""
    frame: FrameType | None = sys._getframe(skip + 1)
    lookup = _by_id.get
    while frame is not None:
        code = frame.f_code
        verdict = lookup(id(code))
        if verdict is None:
            verdict = _classify(code)
        if verdict == _USER:
            return (code, frame.f_lasti)
        if verdict == _PACKAGE:
            return _with_user_frame(code, frame.f_lasti, frame.f_back)
        if verdict == _STATE_MAKER and not through_state_makers:
            return NOT_OWNED
        frame = frame.f_back
    return None


def _with_user_frame(code: CodeType, lasti: int, frame: FrameType | None) -> Site:
    """A package frame's site, with the user's own frame further out when there is one."""
    lookup = _by_id.get
    while frame is not None:
        outer = frame.f_code
        verdict = lookup(id(outer))
        if verdict is None:
            verdict = _classify(outer)
        if verdict == _USER:
            return (code, lasti, outer, frame.f_lasti)
        frame = frame.f_back
    return (code, lasti)


def user_site(skip: int = 1) -> Site:
    """The innermost user frame's site, skipping ``skip`` frames (state makers ignored)."""
    site = capture_site(skip + 1)
    return None if isinstance(site, NotOwned) else site


def caller_site(skip: int = 1) -> Site:
    """The innermost user frame's site, skipping ``skip`` frames and every torch frame, state
    makers included: for code that torch's machinery runs on the user's behalf (the compiled
    graphs of _compiled.py run under torch._dynamo's frames)."""
    site = capture_site(skip + 1, through_state_makers=True)
    assert not isinstance(site, NotOwned)  # never, when walking through state makers
    return site


def site_file_line(site: Site) -> tuple[str, int] | None:
    """``(filename, lineno)`` of a site's innermost frame (the library's, in a package)."""
    if site is None:
        return None
    return _file_line(site[0], site[1])


def user_file_line(site: Site) -> tuple[str, int] | None:
    """``(filename, lineno)`` of the user's own frame of a site (its only frame outside
    packages)."""
    if site is None:
        return None
    if len(site) == 4:
        return _file_line(site[2], site[3])
    return _file_line(site[0], site[1])


def _file_line(code: CodeType, lasti: int) -> tuple[str, int]:
    line = code.co_firstlineno
    for start, end, lineno in code.co_lines():
        if start <= lasti < end:
            if lineno is not None:
                line = lineno
            break
    return (code.co_filename, line)


def format_site(site: Site) -> str:
    """``"train.py:42"`` style text; a site in an installed package names the user's own line
    and then the library's: ``"train.py:42 (in .../modeling_bert.py:1111)"``."""
    where = site_file_line(site)
    if where is None:
        return "an unknown site (no user frame: created by torch internals)"
    if site is not None and len(site) == 4:
        user = _file_line(site[2], site[3])
        return f"{user[0]}:{user[1]} (in {where[0]}:{where[1]})"
    return f"{where[0]}:{where[1]}"
