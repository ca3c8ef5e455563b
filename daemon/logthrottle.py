"""Warnings about what a caller does wrong, at most a few per caller and minute.

A refusal logged once per attempt lets any local user fill the daemon's log (issue 19: a user outside the
group wrote 27,440 ``agent.refused`` warnings, 4.3 MB, in 5 s through the agent socket). A
:class:`Throttle` lets ``burst`` warnings of one key (a uid) through per ``window_s``; the next one let
through after a quiet spell carries how many were left out meanwhile.
"""

from __future__ import annotations

import threading
import time


class Throttle:
    """Per-key counter of warnings let through in the current window (thread-safe)."""

    def __init__(self, burst: int = 5, window_s: float = 60.0):
        self.burst, self.window_s = burst, window_s
        self._lock = threading.Lock()
        self._windows: dict[int, tuple[float, int, int]] = {}
        """key -> (window start, let through in it, left out since the last one let through)."""

    def allow(self, key: int) -> int | None:
        """``None``: leave this warning out; else log it, with this many left out before it (0: none)."""
        now = time.monotonic()
        with self._lock:
            start, shown, dropped = self._windows.get(key, (now, 0, 0))
            if now - start >= self.window_s:
                start, shown = now, 0
            if shown >= self.burst:
                self._windows[key] = (start, shown, dropped + 1)
                return None
            self._windows[key] = (start, shown + 1, 0)
            if len(self._windows) > 4096:  # forget quiet keys: one entry per uid seen this window
                self._windows = {k: v for k, v in self._windows.items() if now - v[0] < self.window_s}
            return dropped
