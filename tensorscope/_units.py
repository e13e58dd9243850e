"""Byte sizes: parse "6GiB" / "1.5GB" / 4096, and print sizes for humans.

Pure Python, no torch: layer 0.
"""

from __future__ import annotations

import math
import re

from tensorscope.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["ACCEPTED_SIZE_FORMS", "format_bytes", "parse_bytes"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")

ACCEPTED_SIZE_FORMS = (
    'a positive int of bytes (e.g. 4096) or a string such as "300MiB", "6GiB", "1.5GB", "512KB"'
)


def parse_bytes(value: object, *, what: str = "size", subsystem: str = "tensorscope") -> int:
    """Return ``value`` as a positive number of bytes.

    Accepts an ``int`` (bytes), or a string of a number and a unit: ``B``, ``KB``/``MB``/``GB``/
    ``TB`` (powers of 1000) or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024), case-insensitive.
    Fractions are rounded down to whole bytes.

    Raises:
        InvalidArgumentError: zero, negative, NaN or unparsable values (``"12 parsecs"``).
        ArgumentTypeError: anything that is neither an int nor a string (floats are refused too,
            since ``1e9`` bytes is better written ``"1GB"``).

    Example:
        >>> parse_bytes("1.5KiB")
        1536
        >>> parse_bytes(4096)
        4096
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ArgumentTypeError(
            f"{subsystem}: {what} must be {ACCEPTED_SIZE_FORMS}; got {type(value).__name__} "
            f"{value!r}"
        )
    if isinstance(value, int):
        if value <= 0:
            raise InvalidArgumentError(
                f"{subsystem}: {what} must be positive; got {value}. Use {ACCEPTED_SIZE_FORMS}."
            )
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(3).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidArgumentError(
            f"{subsystem}: cannot parse {what} {value!r}; use {ACCEPTED_SIZE_FORMS}."
        )
    try:
        number = float(match.group(1)) * (10.0 ** int(match.group(2) or 0))
        nbytes = number * _UNITS[unit]
    except OverflowError:
        nbytes = math.inf
    if not math.isfinite(nbytes):
        raise InvalidArgumentError(
            f"{subsystem}: {what} {value!r} is too large to be a size; use {ACCEPTED_SIZE_FORMS}."
        )
    if int(nbytes) <= 0:
        raise InvalidArgumentError(
            f"{subsystem}: {what} must be at least one byte; got {value!r}. "
            f"Use {ACCEPTED_SIZE_FORMS}."
        )
    return int(nbytes)


def format_bytes(nbytes: float) -> str:
    """Format a byte count with binary units: ``format_bytes(1536) == "1.5 KiB"``.

    Example:
        >>> format_bytes(3 * 1024**3)
        '3.0 GiB'
    """
    sign = "-" if nbytes < 0 else ""
    size = float(abs(nbytes))
    if size < 1024:
        return f"{sign}{int(size)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024.0
        if size < 1024 or unit == "TiB":
            return f"{sign}{size:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
