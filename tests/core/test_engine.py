"""Which scope engine runs: the C++ one wherever it can be built, the Python one on request."""

from __future__ import annotations

import os
import shutil

from tensorscope._engine import FAST, engine_name


def test_the_cpp_engine_is_in_use_where_a_compiler_could_build_it() -> None:
    """An install on a machine with a C++ compiler builds ``tensorscope._fast``; a silent
    fallback to the Python engine would leave the C++ engine untested (and users slower)."""
    if os.environ.get("TENSORSCOPE_ENGINE", "").lower() == "python":
        assert FAST is None and engine_name() == "python"
    elif shutil.which("c++") or shutil.which("g++"):
        assert FAST is not None, (
            "tensorscope._fast was not built: reinstall with `pip install -e .` (tox uses "
            "usedevelop) and read the build output"
        )
        assert engine_name() == "c++"
