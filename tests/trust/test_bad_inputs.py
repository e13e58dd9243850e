"""#17: bad arguments raise the tensorscope error of API.md §6 at the call (never a raw Python
error, never a failure later), and a few silently surprising behaviours."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.checkpoint import Chain, simulate, solve

from . import _models as M


def test_an_overflowing_budget_string_is_an_invalid_argument() -> None:
    """#17: configure(budget="1e400") raises InvalidArgumentError."""
    with pytest.raises(ts.InvalidArgumentError, match=r"tensorscope\.residency"):
        ts.residency.configure(budget="1e400")


def test_a_non_path_offload_dir_is_an_argument_type_error() -> None:
    """#17: configure(offload_dir=5) raises ArgumentTypeError."""
    with pytest.raises(ts.ArgumentTypeError, match=r"tensorscope\.residency"):
        ts.residency.configure(offload_dir=5)  # type: ignore[arg-type]


def test_move_to_scope_of_a_non_scope_is_an_argument_type_error() -> None:
    """#17: t.move_to_scope(5) raises ArgumentTypeError and leaves the ref in its scope."""
    with ts.scope() as s:
        t = torch.ones(2)
        with pytest.raises(ts.ArgumentTypeError, match=r"tensorscope\.scope"):
            t.move_to_scope(5)  # type: ignore[arg-type]
        assert t.scope is s


def test_manage_with_a_non_manager_is_an_argument_type_error() -> None:
    """#17: ts.manage(m, manager=5) raises ArgumentTypeError and leaves m plain."""
    model = nn.Linear(2, 2)
    with pytest.raises(ts.ArgumentTypeError, match=r"tensorscope\.residency"):
        ts.manage(model, manager=5)  # type: ignore[arg-type]
    assert all(type(p) is nn.Parameter for p in model.parameters())


@pytest.mark.filterwarnings("ignore::tensorscope.ResidencyWarning")  # "left unmanaged"
def test_manage_of_a_module_with_a_sparse_buffer_fails_at_the_call_or_works() -> None:
    """#17: manage() of a module with a sparse buffer fails at the call or works end to end.

    Either is accepted: a TensorScopeError from ``manage()``, or a managed module whose forward
    in a scope equals plain and whose ``remove()`` gives the sparse buffer back.
    """
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    model.register_buffer("mask", torch.eye(2).to_sparse())
    x = torch.ones(1, 2)
    expected = model(x).detach()
    ts.residency.configure(budget="1MiB")
    try:
        handle = ts.manage(model)
    except ts.TensorScopeError:
        return
    with ts.scope():
        assert torch.equal(model(x), expected)
    handle.remove()
    assert torch.equal(model.mask.to_dense(), torch.eye(2))


def test_checkpoint_loading_arguments_of_the_wrong_type_are_argument_type_errors() -> None:
    """empty_init(include_buffers=...) takes a bool and manage(checkpoint=...) a path: anything
    else raises ArgumentTypeError at the call, and the module stays unmanaged."""
    with (
        pytest.raises(ts.ArgumentTypeError, match=r"tensorscope\.residency.*bool"),
        ts.empty_init(include_buffers="yes"),  # type: ignore[arg-type]
    ):
        pass
    model = nn.Linear(2, 2)
    with pytest.raises(ts.ArgumentTypeError, match=r"tensorscope\.residency.*path"):
        ts.manage(model, checkpoint=5)  # type: ignore[arg-type]
    assert type(model.weight) is nn.Parameter


def test_solve_without_a_chain_is_an_argument_type_error() -> None:
    """#17: solve(None, limit) raises ArgumentTypeError."""
    with pytest.raises(ts.ArgumentTypeError, match=r"tensorscope\.checkpoint"):
        solve(None, 100)  # type: ignore[arg-type]


def test_simulate_without_ops_is_an_argument_type_error() -> None:
    """#17: simulate(chain, None) raises ArgumentTypeError."""
    chain = Chain([1, 1], [1, 1], [4, 4, 4], [0, 8, 8], [0, 0], [0, 0])
    with pytest.raises(ts.ArgumentTypeError, match=r"tensorscope\.checkpoint"):
        simulate(chain, None)  # type: ignore[arg-type]


def test_a_policy_class_instead_of_an_instance_is_refused_at_configure() -> None:
    """#17: configure(policy=ts.Flow) (the class) raises ArgumentTypeError at the call."""
    with pytest.raises(ts.ArgumentTypeError, match=r"tensorscope\.residency"):
        ts.residency.configure(policy=ts.Flow)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("limit", "error"),
    [
        ("x", ts.ArgumentTypeError),
        (math.nan, (ts.InvalidArgumentError, ts.ArgumentTypeError)),
        (-1, ts.InvalidArgumentError),
    ],
    ids=["str", "nan", "negative"],
)
def test_flow_refuses_a_bad_prefetch_limit_at_construction(
    limit: object, error: type[Exception] | tuple[type[Exception], ...]
) -> None:
    """#17: Flow(prefetch_limit="x" / nan / -1) raises at construction."""
    with pytest.raises(error):
        ts.Flow(prefetch_limit=limit)  # type: ignore[arg-type]


def test_an_empty_offload_dir_is_refused_not_taken_as_the_current_directory() -> None:
    """#17: configure(offload_dir="") is refused instead of meaning the current directory.

    InvalidArgumentError or ResidencyError are both accepted (the issue does not pick one).
    """
    with pytest.raises((ts.InvalidArgumentError, ts.ResidencyError)):
        ts.residency.configure(offload_dir="")


def test_an_open_empty_scope_is_truthy() -> None:
    """#17: bool() of an open scope that owns nothing is True."""
    with ts.scope() as s:
        assert len(s) == 0
        assert bool(s) is True


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root (chown)")
def test_an_offload_dir_owned_by_another_user_is_refused(tmp_path: os.PathLike[str]) -> None:
    """#17: an offload_dir owned by another user raises ResidencyError at configure()."""
    theirs = os.path.join(tmp_path, "theirs")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ts.ResidencyError, match="another user"):
        ts.residency.configure(offload_dir=theirs)


# The default (private) offload directory is made under TMPDIR; the child makes it, says so, and
# gets a signal with Python's default handling of it.
SIGNAL_AFTER_THE_PRIVATE_DIR_EXISTS = r"""
import os, signal, sys, time, torch, tensorscope as ts
ts.residency.configure(device="cpu", policy="flow", budget=None, offload_dir=None)
t = ts.ref(torch.ones(1024))
t.demote()
print("made", os.listdir(os.environ["TMPDIR"]), flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
time.sleep(30)
print("still running", flush=True)
"""


def _private_dir_after(signal_name: str, tmp_path: os.PathLike[str]) -> None:
    tmpdir = os.path.join(tmp_path, "tmp")
    os.mkdir(tmpdir)
    done = M.run_child(SIGNAL_AFTER_THE_PRIVATE_DIR_EXISTS, signal_name, env={"TMPDIR": tmpdir})
    assert "made ['" in done.stdout, M.describe(done)  # the private directory existed
    assert "still running" not in done.stdout, "the signal did not end the process"
    assert done.returncode != 0, M.describe(done)
    assert os.listdir(tmpdir) == [], f"left behind: {os.listdir(tmpdir)}"


def test_the_private_offload_dir_is_removed_on_sigterm(tmp_path: os.PathLike[str]) -> None:
    """#17: SIGTERM removes the private offload directory and still ends the process."""
    _private_dir_after("SIGTERM", tmp_path)


def test_the_private_offload_dir_is_removed_on_sigint(tmp_path: os.PathLike[str]) -> None:
    """#17: SIGINT removes the private offload directory and still ends the process.

    A guard: this passes on today's code (KeyboardInterrupt, then atexit); it is kept so that a
    SIGTERM fix cannot break the SIGINT path.
    """
    _private_dir_after("SIGINT", tmp_path)
