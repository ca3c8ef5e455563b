"""An interactive bash in a real pseudo-terminal, with job control: what a person types into a terminal.

``bash -i`` runs as the session leader of a fresh pty (``pty.fork``: ``setsid`` and the pty as its
controlling terminal), so ``CMD &`` makes a background job in the shell's session with stdio on the
terminal, as in a terminal emulator or tmux. :meth:`Shell.run` types one line and returns what the
terminal showed until the shell's prompt came back.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import threading
import time
from pathlib import Path

PROMPT = "gpusnap-test$ "
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


class Shell:
    """``bash --norc -i`` on a pty in ``cwd``; :meth:`close` ends it and its jobs' process group leaders."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # a terminal's shell starts with stdin, stdout and stderr only (not pytest's pipes)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            os.chdir(cwd)
            os.execvpe(
                "bash",
                ["bash", "--norc", "--noprofile", "-i"],
                {**env, "PS1": PROMPT, "PS2": "", "TERM": "dumb", "COLUMNS": "200", "LINES": "50"},
            )
        self.transcript = ""
        self._held = b""
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._read_until_prompt(30)

    def run(self, line: str, timeout: float = 120) -> str:
        """Type ``line`` (and Enter); what the terminal showed until the next prompt, the echo left out."""
        os.write(self.fd, line.encode() + b"\n")
        out = self._read_until_prompt(timeout)
        echoed, _, rest = out.partition("\n")
        return rest if echoed.strip() == line.strip()[: len(echoed.strip())] else out

    def start(self, line: str) -> None:
        """Type ``line``, a command that keeps the terminal (a server in the foreground); what it shows is read in
        the background (a full terminal would stop it) until :meth:`interrupt`."""
        os.write(self.fd, line.encode() + b"\n")
        self._stop.clear()
        self._reader = threading.Thread(target=self._hold, name="pty-shell-reader", daemon=True)
        self._reader.start()

    def _hold(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                try:
                    self._held += os.read(self.fd, 65536)
                except OSError:
                    return

    def interrupt(self, timeout: float = 60) -> str:
        """Ctrl-C to the command :meth:`start` typed; everything it showed, once the prompt is back."""
        self._stop.set()
        if self._reader is not None:
            self._reader.join()
        os.write(self.fd, b"\x03")
        return self._read_until_prompt(timeout)

    def _read_until_prompt(self, timeout: float) -> str:
        buf, self._held = self._held, b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    break
                buf += chunk
                text = ANSI.sub("", buf.decode(errors="replace"))
                if text.endswith(PROMPT):
                    self.transcript += text
                    return text.removesuffix(PROMPT)
        raise AssertionError(
            f"no prompt within {timeout} s; the terminal showed:\n{self.transcript}{buf.decode(errors='replace')}"
        )

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)
