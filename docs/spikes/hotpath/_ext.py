"""Builds (JIT, cached on disk) and loads the spike extension hotpath.cpp."""

from __future__ import annotations

import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_DIR = os.environ.get("HOTPATH_BUILD_DIR", "/tmp/hotpath_build")

_ext = None
build_seconds = None


def load(verbose: bool = False):
    global _ext, build_seconds
    if _ext is None:
        from torch.utils.cpp_extension import load as _load

        os.makedirs(BUILD_DIR, exist_ok=True)
        start = time.perf_counter()
        _ext = _load(
            name="ts_hotpath_spike",
            sources=[os.path.join(HERE, "hotpath.cpp")],
            build_directory=BUILD_DIR,
            extra_cflags=["-O2"],
            verbose=verbose,
        )
        build_seconds = time.perf_counter() - start
    return _ext
