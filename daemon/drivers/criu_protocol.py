"""The CRIU helper's protocol: what gpusnapd (``drivers.criu``) and its helper (``drivers.criu_exec``) say.

gpusnapd writes one :class:`Request` line on the helper's stdin; the helper writes :class:`Event` lines on its
stdout, each with one field set: ``init`` (a restore into a fresh PID namespace: its init's host PID),
``start`` (a restore: CRIU gets its request once gpusnapd has journaled the helper and the init, and answered),
``notify`` (a CRIU notification gpusnapd answers: ``post-dump``, ``post-restore``, ``pre-resume``), and last
``result``. gpusnapd answers ``start`` and each ``notify`` with an :class:`Answer` line. Every line is one
frozen type of this module through the saved documents' one codec (``gpusnap.daemon.store.documents``), so
mypy checks both ends; the namespace init hands its :class:`Result` to the helper the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from gpusnap.daemon.api.types import Creds, FileCopy, ProcessImage
from gpusnap.daemon.drivers.filecopies import CopySpec
from gpusnap.daemon.drivers.pagefill import Stats
from gpusnap.daemon.store import documents


@dataclasses.dataclass(frozen=True)
class CriuOpts:
    """The ``criu_opts`` fields gpusnap sets (CRIU's images/rpc.proto); ``None`` and empty ones are left unset
    (CRIU's defaults)."""

    pid: int | None = None
    """Dump: the tree's root, as seen where CRIU runs."""
    shell_job: bool | None = None
    ext_unix_sk: bool | None = None
    file_locks: bool | None = None
    link_remap: bool | None = None
    """What every gpusnap request allows: a shell's job, external unix sockets, file locks, link remaps."""
    leave_running: bool | None = None
    """Dump: the source runs on."""
    leave_stopped: bool | None = None
    """Every task is left stopped (a dump in the tree's PID namespace; a standby's restore)."""
    ghost_limit: int | None = None
    """The largest deleted file copied into the images, bytes."""
    log_level: int | None = None
    log_file: str | None = None
    """CRIU's log, named in its working directory."""
    timeout: int | None = None
    """Dump: seconds the tree may take to freeze."""
    tcp_established: bool | None = None
    tcp_close: bool | None = None
    network_lock: int | None = None
    """TCP connections restored (locked meanwhile, by this method) or closed."""
    external: tuple[str, ...] = ()
    """Resources outside the tree (``tty[rdev:dev]``: a terminal left behind)."""
    inherit_fd: tuple[tuple[str, int], ...] = ()
    """Descriptors CRIU inherits (passed to it at its start), each by the key its images name the file with:
    ``tty[rdev:dev]``, ``socket:[ino]``, a path without its first ``/``, or a path."""


@dataclasses.dataclass(frozen=True)
class Terminals:
    """Terminals a shell's job was started from, left behind at the dump (their ``tty[…]`` keys): the restored
    tree gets a fresh pty instead, whose output goes to ``path`` (``""``: /dev/null), opened as ``owner``."""

    keys: tuple[str, ...]
    """CRIU's names of the terminals, ``tty[rdev:dev]``."""
    path: str
    owner: Creds
    """Who opens ``path``: the tree's user."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One CRIU request (``criu_exec``'s module docstring says what each field does)."""

    action: Literal["dump", "restore"]
    images_dir: str
    work_dir: str
    opts: CriuOpts
    new_pidns: bool = False
    """Restore: into a fresh PID and mount namespace, whose init stays as the tree's reaper."""
    new_netns: bool = False
    """Restore (with ``new_pidns``): also a fresh network namespace, ``lo`` up."""
    shm_dir: str = ""
    """Restore (with ``new_pidns``): a private tmpfs on /dev/shm, seeded from this directory."""
    enter_ns_of: int = 0
    """Dump: CRIU runs in this host PID's PID and mount namespaces."""
    terminals: Terminals | None = None
    """Restore with ``new_pidns``."""
    title: tuple[str, ...] = ()
    """Restore with ``new_pidns``: what the init's command line says once the tree runs (``drivers.reaper``)."""
    owner: Creds | None = None
    """Restore of a tree that ran as a user: its path-named unix sockets are made as that user (``criu_userpaths``)."""
    scratch_dir: str = ""
    """Where the images CRIU reads are linked when it must read rewritten ones (an ``owner``, external copies)."""
    file_copies: CopySpec | None = None
    """Restore: copies of the files the tree continues writing, made as their owners (``filecopies``)."""
    page_fill_threads: int = 0
    """Restore: CRIU restores with lazy pages, which the helper fills on this many threads (``drivers.pagefill``;
    ``work_dir`` private to the request); 0: no page fill."""
    timeout_s: float = 0.0
    """The request's own timeout, seconds: a page fill ends by then."""


@dataclasses.dataclass(frozen=True)
class Start:
    """A restore's CRIU is about to get its request (gpusnapd journals these first)."""

    helper: int
    """This helper's PID: its process group holds CRIU."""
    init: int
    """The namespace init's host PID (0: none)."""


@dataclasses.dataclass(frozen=True)
class Notify:
    """A CRIU notification gpusnapd answers (``ASKED_SCRIPTS``): at ``post-dump`` the images are complete and
    the tree still frozen (``image_bytes``: bytes of pages the images hold per process, as CRIU saw it; empty if
    unknown), at ``post-restore`` ``pid`` is the restored root as CRIU sees it, at ``pre-resume`` every task is
    restored and stopped (``page_fill``: what the page fill did, with one)."""

    script: str
    pid: int = 0
    """The restored root, as CRIU sees it (``post-restore``)."""
    image_bytes: tuple[ProcessImage, ...] = ()
    page_fill: Stats | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """How the request ended. Failed: ``errno`` is CRIU's own ``cr_errno`` when CRIU answered (0, ``ESRCH``,
    ``EEXIST`` or ``EBADRQC``: criu/include/cr-errno.h), ``EPIPE``/``ECONNRESET`` when CRIU went away without
    answering, another ``OSError``'s errno or 0 otherwise; refused before CRIU ran (``criu_userpaths.Refused``),
    ``reason`` and ``code`` (a gRPC code name) are set and the message is the daemon's."""

    ok: bool
    pid: int = 0
    """Restore: the restored root's PID, as CRIU sees it."""
    error: str = ""
    errno: int = 0
    """CRIU's ``cr_errno``, or the transport's (see above)."""
    reason: str = ""
    code: str = ""
    file_copies: tuple[FileCopy, ...] = ()
    """Restore: the copies made, if any."""


@dataclasses.dataclass(frozen=True)
class Event:
    """One line of the helper: exactly one field set."""

    init: int = 0
    """A restore into a fresh PID namespace: the host PID of its init (its own line, before ``start``)."""
    start: Start | None = None
    notify: Notify | None = None
    result: Result | None = None
    """The last line."""


@dataclasses.dataclass(frozen=True)
class Answer:
    """gpusnapd's answer to a ``start`` or a ``notify``: go on, or not."""

    ok: bool


def line(message: Request | Event | Answer | Result) -> bytes:
    """``message`` as one line."""
    return documents.encode(message) + b"\n"


def failed(error: str, errno: int = 0) -> Event:
    """A failed request's last line."""
    return Event(result=Result(ok=False, error=error, errno=errno))
