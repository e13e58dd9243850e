"""Checking what ``ts.residency.configure()`` is given: device, policy, budget, offload_dir.

Every bad value raises at the call, with a tensorscope error that says what is accepted.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

import torch

from tensorscope._torch import storage_door_missing
from tensorscope._units import parse_bytes
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError, ResidencyError
from tensorscope.policies import Flow, Genoa, Policy
from tensorscope.residency.backends import check_device

__all__ = [
    "check_offload_dir",
    "check_storage_door",
    "parse_budget",
    "parse_device",
    "parse_policy",
]


def check_storage_door() -> None:
    """Raise ``ResidencyError`` where no managed storage could move (torch without
    ``_swap_data_ptr_`` and without tensorscope's storage module: _torch.py's NOTE)."""
    why = storage_door_missing()
    if why is not None:
        raise ResidencyError(f"tensorscope.residency: nothing can move between tiers: {why}.")


def parse_budget(budget: object) -> int | None:
    if budget is None:
        return None
    return parse_bytes(budget, what="budget", subsystem="tensorscope.residency")


def parse_policy(policy: object) -> Policy:
    if isinstance(policy, str):
        factories: dict[str, Callable[[], Policy]] = {"flow": Flow, "genoa": Genoa}
        named = factories.get(policy.lower())
        if named is None:
            raise InvalidArgumentError(
                f"tensorscope.residency: unknown policy {policy!r}; use 'flow', 'genoa', "
                "ts.Flow(), ts.Genoa() or an object with evict() and after_op() (see "
                "tensorscope.policies.Policy)."
            )
        return named()
    if isinstance(policy, type):
        raise ArgumentTypeError(
            f"tensorscope.residency: policy must be an instance; got the class "
            f"{policy.__name__}. Write policy={policy.__name__}() (or the name "
            f"{policy.__name__.lower()!r})."
        )
    if callable(getattr(policy, "evict", None)) and callable(getattr(policy, "after_op", None)):
        return policy  # type: ignore[return-value]
    raise ArgumentTypeError(
        f"tensorscope.residency: policy must be 'flow', 'genoa' or a Policy object; got "
        f"{type(policy).__name__}."
    )


def parse_device(device: object) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise ArgumentTypeError(
            f"tensorscope.residency: device must be 'cpu', 'cuda' or a torch.device; got "
            f"{type(device).__name__}."
        )
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"tensorscope.residency: unknown device {device!r}; use 'cpu' or 'cuda'."
        ) from exc
    check_device(parsed)  # one a backend serves here
    return parsed


def check_offload_dir(offload_dir: object) -> str | None:
    """The absolute path of a usable offload directory, or None for a private one.

    Refused: a non-path, an empty string (it would silently mean the current directory), and
    an existing directory owned by another user or writable by others without the sticky bit
    (others could read or replace the offload files; the rule ssh applies to its files).
    """
    if offload_dir is None:
        return None
    if not isinstance(offload_dir, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"tensorscope.residency: offload_dir must be a path (str or os.PathLike) or None; "
            f"got {type(offload_dir).__name__}."
        )
    path = os.fspath(offload_dir)
    if not isinstance(path, str) or path == "":
        raise InvalidArgumentError(
            "tensorscope.residency: offload_dir is empty; give a directory, or None for a "
            "private temporary one (an empty path would mean the current directory)."
        )
    path = os.path.abspath(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return path  # created by the disk tier
    except OSError as exc:
        raise ResidencyError(
            f"tensorscope.residency: cannot use offload_dir {path!r}: {exc.strerror}."
        ) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise ResidencyError(
            f"tensorscope.residency: offload_dir {path!r} exists and is not a directory."
        )
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise ResidencyError(
            f"tensorscope.residency: offload_dir {path!r} belongs to another user (uid "
            f"{info.st_uid}); offload files there could be read or replaced by them. Use a "
            "directory of your own, or offload_dir=None for a private one."
        )
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise ResidencyError(
            f"tensorscope.residency: offload_dir {path!r} is writable by every user; use a "
            "private directory (chmod o-w), or offload_dir=None."
        )
    return path
