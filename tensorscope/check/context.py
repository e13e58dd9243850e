"""What a check records while it runs: expectations (pass/fail rows) and evidence (numbers).

A check is a function ``run(ctx)``. ``ctx.expect(...)`` adds a row of the table, ``ctx.note(...)``
a number or text the table prints under it. Both are written to the worker's result file at
once, so a check that is killed for its time still reports what it had found. An expectation
that fails does not stop the check (what follows is evidence too); an exception does, and the
worker reports it with its traceback.

Layer: the check package (above ``fit``); imports only the standard library and torch.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

__all__ = ["Context", "Row"]

Row = dict[str, Any]


class Context:
    """One check's device, size and findings (see the module docstring).

    Args:
        device: where the check runs (``cuda`` or ``cpu``).
        size: ``"full"`` (the acceptance shapes, minutes on a GPU) or ``"small"`` (seconds: the
            CPU run in CI, or a quick look on a GPU).
        out: the result file the worker rewrites after each finding (None: keep in memory).
    """

    def __init__(self, device: torch.device, size: str, out: str | None = None) -> None:
        self.device = device
        self.size = size
        self.out = out
        self.rows: list[Row] = []
        self.evidence: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.started = time.perf_counter()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def small(self) -> bool:
        return self.size == "small"

    def expect(self, what: str, ok: bool, measured: Any, expected: Any) -> bool:
        """A row of the table: ``what`` was ``measured``; ``expected`` says what passes."""
        self.rows.append(
            {"what": what, "ok": bool(ok), "measured": _text(measured), "expected": _text(expected)}
        )
        print(
            f"  {'ok  ' if ok else 'FAIL'} {what}: {_text(measured)} (expected {_text(expected)})"
        )
        self.save()
        return bool(ok)

    def note(self, key: str, value: Any) -> None:
        """Evidence: a number, a text, or a small dict of them, printed under the table."""
        self.evidence[key] = _plain(value)
        print(f"  {key}: {_text(self.evidence[key])}", flush=True)
        self.save()

    def result(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "evidence": self.evidence,
            "seconds": round(time.perf_counter() - self.started, 3),
        }

    def save(self, **extra: Any) -> None:
        """Rewrite the result file; ``extra`` (the status, the environment...) is kept for the
        later writes too."""
        self.meta.update(extra)
        if self.out is None:
            return
        data = self.result()
        data.update(self.meta)
        partial = f"{self.out}.part"
        with open(partial, "w") as file:
            json.dump(data, file, indent=1)
        os.replace(partial, self.out)


def _plain(value: Any) -> Any:
    """JSON-ready: numbers, texts, lists and dicts of them (anything else as its str)."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_text(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return str(value)
