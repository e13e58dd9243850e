"""Removing the private offload directories when the process is killed by SIGTERM.

The private directory (``offload_dir=None``) is removed at exit by a finalizer; its files have no
names, so nothing else is ever left. SIGINT raises ``KeyboardInterrupt`` and exits through the
finalizers too, but SIGTERM's default action ends the process without them: a handler removes
the directories first, then lets SIGTERM do what it would have done. It is installed only where
nobody has set a SIGTERM handler of their own (and only from the main thread, as Python
requires).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from tensorscope.residency.tempdirs import remove_private_dirs

__all__ = ["watch_private_dirs"]

_installed: list[bool] = []


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    remove_private_dirs()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def watch_private_dirs() -> None:
    """Install the SIGTERM handler once, if SIGTERM still has its default action."""
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    _installed.append(True)
