"""CriuDriver: CRIU dump and restore of process trees, through pycriu's swrk RPC.

Each request runs in a helper process (``gpusnap.daemon.drivers.criu_exec``) so gpusnapd never forks
from its threaded process, a hung CRIU can be killed as a group, and a restore can be placed in a fresh
PID namespace. CRIU's log is written to the work directory (kept with the snapshot); on failure the
raised error carries its relevant lines.

CRIU >= 4.1 is required: on Linux >= 6.13 older releases stop with "vdso: Unexpected rt vDSO area
bounds" (checkpoint-restore/criu#2532, fixed by PR #2539 in 4.1). On Linux >= 6.16, CRIU >= 4.2 is
required: 4.1.x cannot dump any inet socket there ("sockets: Can't get 1:16 opt: Operation not
supported", checkpoint-restore/criu#2718, fixed in 4.2), and inference workers always hold some.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from gpusnap.daemon.api.errors import (
    AbortedError,
    DeadlineExceededError,
    FailedPreconditionError,
    GpusnapError,
)
from gpusnap.daemon.api.types import TcpMode

log = structlog.get_logger(__name__)

MIN_VERSION = (4, 1)
MIN_VERSION_SO_PASSCRED = (4, 2)
"""Needed on kernels >= 6.16 (criu#2718)."""
LOG_LINES = 12
GHOST_LIMIT_BYTES = 1 << 30
"""Largest deleted file CRIU copies into the images (CRIU's default, 1 MiB, refuses vLLM's 4 MiB
TP shared-memory buffers once unlinked: "Can't dump ghost file ... of 4198400 size, increase limit")."""
NETWORK_LOCK_NFTABLES = 2
"""rpc.proto ``criu_network_lock_method.NFTABLES``: lock TCP connections through libnftables (in the
CRIU prefix) instead of running ``iptables``, which Debian 12 hosts lack ("exited, status=127 |
Iptables configuration failed | tcp: Failed to lock TCP connection")."""


@dataclasses.dataclass(frozen=True)
class RestoredTree:
    """A restored tree: ``init_pid`` is the host PID of its namespace's init (0 without a new
    namespace); ``ns_pid`` the root's PID as CRIU created it (its original PID)."""

    init_pid: int
    ns_pid: int


class CriuError(GpusnapError):
    """CRIU refused or failed; ``log_lines`` holds the relevant lines of its log."""

    def __init__(self, message: str, *, code_cls: type[GpusnapError], reason: str, log_lines: list[str], **kw: Any):
        super().__init__(message, reason=reason, **kw)
        self.code = code_cls.code
        self.log_lines = log_lines


class CriuDriver:
    """Drive one CRIU installation.

    Args:
        binary: the ``criu`` executable (the wrapper of gpusnap's private prefix, or a system one).
        pycriu_path: directory that holds the ``pycriu`` package, added to the helper's ``PYTHONPATH``;
            empty when pycriu is importable already.
        failed_logs_dir: directory that keeps CRIU's log of a failed request (its own directory may be
            removed, as a failed dump's staging directory is).
    """

    def __init__(self, binary: str, pycriu_path: str = "", failed_logs_dir: Path | None = None):
        self.binary = binary
        self.pycriu_path = pycriu_path
        self.failed_logs_dir = failed_logs_dir
        """Where the logs of failed dumps are kept (their staging directory is removed)."""
        self._spare_lock = threading.Lock()
        self._spare: subprocess.Popen[bytes] | None = None
        self._keep_spare = False

    def keep_spare_helper(self) -> None:
        """From now on keep one helper process started ahead, waiting for its request.

        A helper's interpreter start and its imports (pycriu and protobuf: 0.3–0.6 s on a loaded
        2-core host, ``make bench-overhead``) then run between requests instead of inside one. The
        spare has read nothing yet, so it is as fresh as a new one: it forks and enters namespaces
        only once it has its request. :meth:`close` ends it.
        """
        with self._spare_lock:
            self._keep_spare = True
            if self._spare is None:
                self._spare = self._spawn()

    def close(self) -> None:
        """End the spare helper, if any (it exits at once: its stdin is closed)."""
        with self._spare_lock:
            self._keep_spare = False
            spare, self._spare = self._spare, None
        if spare is not None:
            _end_helper(spare)

    def version(self) -> str:
        """CRIU's version string, e.g. ``"4.1.1"``.

        Raises:
            FailedPreconditionError: CRIU missing or not runnable (reason ``CRIU_MISSING``).
        """
        try:
            out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            raise FailedPreconditionError(
                f"cannot run CRIU at {self.binary!r} ({exc}); install it with `make criu` or set criu_binary",
                reason="CRIU_MISSING",
            ) from exc
        match = re.search(r"Version:\s*(\S+)", out.stdout)
        if not match:
            raise FailedPreconditionError(
                f"cannot parse `criu --version` output: {out.stdout!r}", reason="CRIU_MISSING"
            )
        return match.group(1)

    def require_supported(self) -> str:
        """Return the version if it is >= 4.1 and pycriu imports; raise otherwise.

        Raises:
            FailedPreconditionError: reason ``CRIU_TOO_OLD``, ``CRIU_MISSING`` or ``PYCRIU_MISSING``.
        """
        version = self.version()
        parts = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
        kernel = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
        if parts < MIN_VERSION:
            raise FailedPreconditionError(
                f"CRIU {version} is too old: gpusnap needs CRIU >= 4.1 (older releases fail on Linux >= 6.13 "
                "with 'Unexpected rt vDSO area bounds'); install it with `make criu`",
                reason="CRIU_TOO_OLD",
                metadata={"criu_version": version},
            )
        if kernel >= (6, 16) and parts < MIN_VERSION_SO_PASSCRED:
            raise FailedPreconditionError(
                f"CRIU {version} is too old for Linux {os.uname().release}: on kernels >= 6.16 it cannot dump "
                "processes with TCP sockets (criu#2718); gpusnap needs CRIU >= 4.2 here: install it with `make criu`",
                reason="CRIU_TOO_OLD",
                metadata={"criu_version": version},
            )
        probe = subprocess.run(
            [sys.executable, "-c", "import pycriu"], env=self._env(), capture_output=True, text=True, timeout=60
        )
        if probe.returncode != 0:
            raise FailedPreconditionError(
                f"pycriu cannot be imported ({probe.stderr.strip().splitlines()[-1:]}); install it with `make criu`",
                reason="PYCRIU_MISSING",
            )
        return version

    def dump(
        self,
        *,
        pid: int,
        images_dir: Path,
        work_dir: Path,
        leave_running: bool,
        tcp: TcpMode,
        freeze_timeout_s: int,
        leave_stopped: bool = False,
        timeout_s: float,
        enter_ns_of: int = 0,
        on_start: Callable[[int], None] | None = None,
        on_post_dump: Callable[[], None] | None = None,
    ) -> None:
        """Dump the tree rooted at ``pid`` into ``images_dir``; CRIU's log goes to ``work_dir/dump.log``.

        Args:
            pid: root PID as seen from the namespace CRIU runs in (see ``enter_ns_of``).
            enter_ns_of: host PID whose PID and mount namespaces CRIU runs in (0: gpusnapd's own).
            leave_stopped: leave the dumped tree stopped instead of killing it (CRIU ``--leave-stopped``);
                the caller kills it. Needed when CRIU runs inside the tree's PID namespace, which dies
                with the tree, CRIU and the helper included, before CRIU could answer.
            on_start: called with the helper's PID once it runs (used by fault-injection tests).
            on_post_dump: called once the images are complete while the tree is still frozen (CRIU's
                ``post-dump`` notification). If it raises, CRIU fails the dump and resumes the tree,
                and the exception is re-raised here: this is how a snapshot is published before the
                source is killed, so a failed publish never loses the source.

        Raises:
            CriuError: CRIU refused (FAILED_PRECONDITION, with log lines) or died (ABORTED).
            DeadlineExceededError: not done within ``timeout_s``; CRIU was killed.
        """
        opts: dict[str, Any] = {
            "pid": pid,
            "shell_job": True,
            "ext_unix_sk": True,
            "file_locks": True,
            "link_remap": True,
            "leave_running": leave_running,
            "leave_stopped": leave_stopped,
            "ghost_limit": GHOST_LIMIT_BYTES,
            "log_level": 4,
            "log_file": "dump.log",
            "timeout": freeze_timeout_s,
        }
        if tcp is TcpMode.ESTABLISHED:
            opts["tcp_established"] = True
            opts["network_lock"] = NETWORK_LOCK_NFTABLES
        elif tcp is TcpMode.CLOSE:
            opts["tcp_close"] = True
        req: dict[str, Any] = {"action": "dump", "images_dir": str(images_dir), "work_dir": str(work_dir), "opts": opts}
        if enter_ns_of:
            req["enter_ns_of"] = enter_ns_of
        handler = _NotifyHandler({"post-dump": lambda _event, _events: on_post_dump()}) if on_post_dump else None
        self._run(req, work_dir / "dump.log", timeout_s, on_start=on_start, on_notify=handler)

    def restore(
        self,
        *,
        images_dir: Path,
        work_dir: Path,
        log_name: str,
        new_pidns: bool,
        tcp: TcpMode,
        timeout_s: float,
        new_netns: bool = False,
        shm_dir: Path | None = None,
        before_resume: Callable[[RestoredTree], None] | None = None,
        private_log: bool = False,
        before_criu: Callable[[int, int], None] | None = None,
    ) -> RestoredTree:
        """Restore the tree dumped in ``images_dir``; the log goes to ``work_dir/<log_name>``.

        Args:
            before_criu: called with the helper's PID and the namespace init's (0 without ``new_pidns``)
                before CRIU runs; CRIU runs only once it has returned (so a caller can journal where the
                tree will be: everything CRIU restores lives under that init, or is started after that
                helper). If it raises, nothing is restored and the exception is re-raised here.
            before_resume: called at CRIU's ``pre-resume`` notification: every task is restored, with its
                credentials, and stopped before running an instruction of its own (CRIU's
                ``finalize_restore``). If it raises, it must have killed the tree (CRIU does not stop
                there); the exception is re-raised here.
            private_log: keep CRIU's log lines out of the error (for callers who may not see what CRIU
                saw as root, e.g. the size of a file they cannot stat); the log stays for root.

        Raises:
            CriuError: CRIU refused or died; nothing of the tree is left running.
            DeadlineExceededError: not done within ``timeout_s``; everything restored so far was killed.
        """
        opts: dict[str, Any] = {
            "shell_job": True,
            "ext_unix_sk": True,
            "file_locks": True,
            "link_remap": True,
            "log_level": 4,
            "log_file": log_name,
        }
        if tcp is TcpMode.ESTABLISHED:
            opts["tcp_established"] = True
            opts["network_lock"] = NETWORK_LOCK_NFTABLES
        elif tcp is TcpMode.CLOSE:
            opts["tcp_close"] = True
        if (new_netns or shm_dir) and not new_pidns:
            raise ValueError("a private network or /dev/shm needs the fresh namespaces of new_pidns")
        req = {
            "action": "restore",
            "images_dir": str(images_dir),
            "work_dir": str(work_dir),
            "opts": opts,
            "new_pidns": new_pidns,
            "new_netns": new_netns,
            "shm_dir": str(shm_dir) if shm_dir else "",
        }
        handler = None
        if before_resume:

            def pre_resume(_event: dict[str, Any], events: list[dict[str, Any]]) -> None:
                init = next((e["pid"] for e in events if e.get("event") == "init"), 0)
                root = next(e["pid"] for e in events if e.get("event") == "notify" and e["script"] == "post-restore")
                before_resume(RestoredTree(init_pid=int(init), ns_pid=int(root)))

            handler = _NotifyHandler({"pre-resume": pre_resume})
        events = self._run(
            req, work_dir / log_name, timeout_s, on_notify=handler, private_log=private_log, before_criu=before_criu
        )
        init_pid = next((e["pid"] for e in events if e.get("event") == "init"), 0)
        result = events[-1]
        return RestoredTree(init_pid=init_pid, ns_pid=int(result["pid"]))

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [p for p in (self.pycriu_path, env.get("PYTHONPATH", "")) if p]
        # The helper must import this very gpusnap too (an editable install resolves through sys.path).
        paths.extend(p for p in sys.path if p)
        env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    def _run(
        self,
        req: dict[str, Any],
        log_path: Path,
        timeout_s: float,
        on_start: Callable[[int], None] | None = None,
        on_notify: _NotifyHandler | None = None,
        private_log: bool = False,
        before_criu: Callable[[int, int], None] | None = None,
    ) -> list[dict[str, Any]]:
        req = {**req, "criu": self.binary}
        action = req["action"]
        line = json.dumps(req).encode() + b"\n"
        proc = self._take_helper()
        try:
            _send(proc, line)
        except BrokenPipeError:  # a spare that died while it waited: start afresh
            _end_helper(proc)
            proc = self._spawn()
            _send(proc, line)
        try:  # a failed request must not leave the helper's pipes open in the daemon
            return self._exchange(proc, action, log_path, timeout_s, on_start, on_notify, private_log, before_criu)
        finally:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            if proc.poll() is None:
                self._kill(proc, [])

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "gpusnap.daemon.drivers.criu_exec"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._env(),
            start_new_session=True,
        )

    def _take_helper(self) -> subprocess.Popen[bytes]:
        """The spare helper if it is alive (even if still importing), else a fresh one. The next spare
        is started by another thread (``Popen`` waits for the child's ``exec``: 20–50 ms here), so it is
        ready for the request after this one without delaying this one."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
            refill = self._keep_spare
        if refill:
            threading.Thread(target=self._refill, name="gpusnap-criu-spare", daemon=True).start()
        if spare is not None:
            if spare.poll() is None:
                return spare
            _end_helper(spare)
        return self._spawn()

    def _refill(self) -> None:
        fresh = self._spawn()
        with self._spare_lock:
            kept = self._keep_spare and self._spare is None
            if kept:
                self._spare = fresh
        if not kept:  # closed meanwhile, or another refill won
            _end_helper(fresh)

    def _exchange(
        self,
        proc: subprocess.Popen[bytes],
        action: str,
        log_path: Path,
        timeout_s: float,
        on_start: Callable[[int], None] | None,
        on_notify: _NotifyHandler | None,
        private_log: bool = False,
        before_criu: Callable[[int, int], None] | None = None,
    ) -> list[dict[str, Any]]:
        start_error: BaseException | None = None
        if on_start:
            on_start(proc.pid)
        assert proc.stdin and proc.stdout and proc.stderr
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        buf = b""
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._kill(proc, events)
                    raise DeadlineExceededError(
                        f"CRIU {action} did not finish within {timeout_s:g} s and was killed; "
                        f"see {log_path}; raise the operation timeout if the tree is large",
                        reason="CRIU_TIMEOUT",
                    )
                if not sel.select(timeout=min(remaining, 1.0)):
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    event = json.loads(line)
                    events.append(event)
                    if event.get("event") == "result":  # the last line: no need to wait for EOF
                        buf = b""
                        break
                    if event.get("event") == "start":  # a restore's CRIU waits for this answer
                        try:
                            if before_criu:
                                before_criu(int(event["helper"]), int(event["init"]))
                        except BaseException as exc:  # re-raised once the helper has given up
                            start_error = exc
                        _answer(proc, start_error is None)
                    if event.get("event") == "notify":
                        ok = on_notify.handle(event, events) if on_notify else True
                        _answer(proc, ok)
                        if ok and event["script"] == "post-dump":
                            # The snapshot is published and CRIU now ends the source: killing CRIU for
                            # the deadline here would lose both, so wait for it to finish.
                            deadline = float("inf")
                if events and events[-1].get("event") == "result":
                    break
        finally:
            sel.close()
            proc.stdin.close()
        proc.wait()
        result = events[-1] if events and events[-1].get("event") == "result" else None
        stderr = "" if result else proc.stderr.read().decode(errors="replace").strip()
        proc.stderr.close()
        proc.stdout.close()
        if start_error is not None:
            raise start_error
        if on_notify and on_notify.error and action == "restore":  # the callback killed the tree
            raise on_notify.error
        if result is None:
            lines = log_lines(log_path)
            raise CriuError(
                f"CRIU {action} died before answering (helper exit status {proc.returncode}); "
                f"{_joined(lines) or stderr[-500:]}",
                code_cls=AbortedError,
                reason="CRIU_DIED",
                log_lines=lines,
            )
        if not result["ok"]:
            if on_notify and on_notify.error:
                raise on_notify.error
            lines = log_lines(log_path)
            log_path = self._keep_log(log_path)
            died = any(w in result["error"] for w in ("not running", "Connection", "connection", "Broken pipe"))
            headline = result["error"]
            if lines and any(b in headline for b in BENIGN_LOG_LINES):  # CRIU's first error, not its cause
                headline = lines[0]
            hint = next((h for pattern, h in LOG_HINTS if any(pattern in ln for ln in lines)), "")
            if hint:
                headline = f"{headline} ({hint})"
            details = f"{_joined(lines, LOG_EXCERPT_CHARS)} (full log: {log_path})"
            if private_log:
                headline = hint or "see the log"
                details = f"(the log, {log_path.name}, is kept for root)"
            raise CriuError(
                f"CRIU {action} failed: {headline}. {details}",
                code_cls=AbortedError if died else FailedPreconditionError,
                reason="CRIU_DIED" if died else f"CRIU_{action.upper()}_FAILED",
                log_lines=lines,
            )
        return events

    def _keep_log(self, log_path: Path) -> Path:
        """Copy a failed request's log where it survives its staging directory; returns where it is."""
        if self.failed_logs_dir is None or not log_path.exists():
            return log_path
        try:
            self.failed_logs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            kept = self.failed_logs_dir / f"{log_path.parent.name}-{log_path.name}"
            shutil.copyfile(log_path, kept)
            for old in sorted(self.failed_logs_dir.iterdir(), key=lambda p: p.stat().st_mtime)[:-KEPT_LOGS]:
                old.unlink(missing_ok=True)
            return kept
        except OSError:
            return log_path

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes], events: list[dict[str, Any]]) -> None:
        for event in events:  # a restore's namespace init takes everything inside with it
            if event.get("event") == "init":
                try:
                    os.kill(int(event["pid"]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _send(proc: subprocess.Popen[bytes], line: bytes) -> None:
    assert proc.stdin
    proc.stdin.write(line)
    proc.stdin.flush()


def _answer(proc: subprocess.Popen[bytes], ok: bool) -> None:
    """Answer the helper's question (a notification, the restore's start). A helper already gone (a
    callback that refused killed the namespace init it was waiting on) needs no answer: its result, or
    its end of output, comes next."""
    assert proc.stdin
    try:  # unbuffered: a refused write leaves nothing behind for close() to fail on again
        os.write(proc.stdin.fileno(), json.dumps({"ok": ok}).encode() + b"\n")
    except BrokenPipeError:
        pass


def _end_helper(proc: subprocess.Popen[bytes]) -> None:
    """Close a helper's pipes (an idle helper exits on EOF) and reap it; kill it if it lingers."""
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_Callback = Callable[[dict[str, Any], list[dict[str, Any]]], None]


class _NotifyHandler:
    """Answers CRIU's notifications by calling back (script name -> callback, given the notify event
    and the events so far); keeps a callback's exception."""

    def __init__(self, callbacks: dict[str, _Callback]):
        self.callbacks = callbacks
        self.error: BaseException | None = None

    def handle(self, event: dict[str, Any], events: list[dict[str, Any]]) -> bool:
        callback = self.callbacks.get(event["script"])
        if callback is None:
            return True
        try:
            callback(event, events)
        except BaseException as exc:  # re-raised by _run once CRIU has resumed (or killed) the tree
            self.error = exc
            return False
        return True


KEPT_LOGS = 50
"""Logs of failed requests kept in ``failed_logs_dir``; older ones are removed."""

LOG_HINTS = (
    (
        "has bad size",
        "a file the tree had open changed size after the capture: a log opened without O_APPEND, or a "
        "--leave-running source that kept writing; open logs for appending (`>>`) or give the file back the "
        "size CRIU expects",
    ),
    ("Address already in use", "a restored socket's address is taken: restore with --private-net, or stop its owner"),
    ("Can't fork for", "a PID of the tree is in use: restore without --host-pidns"),
)
"""CRIU log phrases whose cause gpusnap can name, with the fix."""

BENIGN_LOG_LINES = (
    "Can't setup RLIMIT_NOFILE for self",  # CRIU raising its own fd limit without CAP_SYS_RESOURCE
    "restore late stage hook for external plugin failed",  # no plugins loaded
)
"""CRIU log lines marked as errors that never explain a failure."""


def log_lines(path: Path, limit: int = LOG_LINES) -> list[str]:
    """The lines of a CRIU log worth showing: its errors (or its last lines), at most ``limit``."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    errors = [
        ln.strip()
        for ln in lines
        if ("Error" in ln or "error" in ln.split(":", 1)[0]) and not any(b in ln for b in BENIGN_LOG_LINES)
    ]
    return (errors or [ln.strip() for ln in lines])[-limit:]


LOG_EXCERPT_CHARS = 500
"""Characters of CRIU's log quoted in a failed request's message before the kept log's path: the service
caps a message at 1024 characters, and the path must survive that."""


def _joined(lines: list[str], limit: int = 0) -> str:
    text = ("CRIU log: " + " | ".join(lines)) if lines else ""
    return text[: limit - 1] + "…" if limit and len(text) > limit else text
