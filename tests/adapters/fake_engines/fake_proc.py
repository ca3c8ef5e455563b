"""Process set-up the engines do in their children: the title, and dying with the parent. No torch here."""

from __future__ import annotations


def set_title(title: str) -> None:
    """The process title, as the engines set it (``setproctitle``)."""
    import setproctitle

    setproctitle.setproctitle(title)


def die_with_parent() -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``: SGLang's ``kill_itself_when_parent_died``."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
