"""``"modeling_gpt2.py:210 in forward"``: the text of a creation site, as a plan shows it.

A site is what ``tensorscope._sites`` captures (the innermost frame outside torch and
tensorscope: user code, and library code such as transformers' modeling files). Paths are
shortened for reading: below a ``site-packages`` directory the part after it
(``transformers/models/gpt2/modeling_gpt2.py``), below the working directory the relative path,
else the full path.
"""

from __future__ import annotations

import os

from tensorscope._sites import Site, site_file_line

__all__ = ["short_path", "site_text"]

_PACKAGE_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def short_path(filename: str) -> str:
    """A file name as a plan prints it (see the module docstring).

    Example:
        >>> short_path("/venv/lib/python3.11/site-packages/transformers/models/x.py")
        'transformers/models/x.py'
    """
    for marker in _PACKAGE_DIRS:
        cut = filename.rfind(marker)
        if cut >= 0:
            return filename[cut + len(marker) :]
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if relative.startswith("..") else relative


def site_text(site: Site) -> str:
    """``"file.py:12 in function"``, or ``""`` when no user frame was found."""
    where = site_file_line(site)
    if where is None or site is None:
        return ""
    return f"{short_path(where[0])}:{where[1]} in {site[0].co_name}"
