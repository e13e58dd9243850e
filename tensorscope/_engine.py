"""Which scope engine owns op results: the C++ kernel, or the Python one.

Both own results on the same dispatch key (DeferredInit, see tensorscope/_adopt.py's NOTE), with
the same rules. ``tensorscope._fast`` is a small C++ extension built at install time with the
machine's compiler (``setup.py``; see ``csrc/fast.cpp``): a boxed fallback that sees each
top-level op and hands only fresh results to Python. Where it could not be built (no compiler),
or with ``TENSORSCOPE_ENGINE=python``, the same kernel runs in Python (``_fallback.py``), at
about four times the cost per op (docs/design.md §9). The residency manager's op path has the
same two engines (docs/design.md §14): with the C++ one, a second fallback (csrc/managed.cpp, on
the Fake key) runs ops whose managed operands are resident natively and hands the others to the
Python dispatch mode (``_intercept.Interceptor``), which the Python engine runs around every op.

The engine reads and writes Python objects by a layout declared once (``_layout.py``); an
extension whose compiled-in layout differs (built from other sources) is refused at import with
an ``ImportError`` that says how to rebuild it: it cannot be set aside for the Python engine
then, its kernels being registered with torch the moment it is imported.

Layer 2: imports only torch (and the C++ extension of layer 0, the layout of layer 1).
"""

from __future__ import annotations

import os
from typing import Any

from tensorscope._layout import LAYOUT

__all__ = ["FAST", "engine_name"]


def _load() -> Any:
    if os.environ.get("TENSORSCOPE_ENGINE", "").lower() == "python":
        return None
    try:
        import torch  # noqa: F401  (the extension links against torch's libraries)

        from tensorscope import _fast  # type: ignore[attr-defined, unused-ignore]
    except ImportError:
        return None
    engine: Any = _fast
    compiled = engine.layout() if hasattr(engine, "layout") else None
    if compiled != LAYOUT:
        raise ImportError(
            f"tensorscope: the C++ engine {engine.__file__} was built from other sources than "
            "this tensorscope (its layout differs from tensorscope/_layout.py's). Rebuild it "
            "(`pip install -e .`, or `python setup.py build_ext --inplace` in a checkout), or "
            "run the Python engine: TENSORSCOPE_ENGINE=python."
        )
    return engine


FAST: Any = _load()


def engine_name() -> str:
    """ "c++" or "python": which engine owns results inside scopes."""
    return "c++" if FAST is not None else "python"
