"""How a failed CRIU request is classified: by the ``errno`` the helper sends (CRIU's own ``cr_errno`` when
CRIU answered; EPIPE or ECONNRESET when CRIU went away), never by the words of CRIU's message."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import AbortedError, FailedPreconditionError
from gpusnap.daemon.drivers import criu_exec
from gpusnap.daemon.drivers import criu_protocol as protocol
from gpusnap.daemon.drivers.criu import CRIU_GONE_ERRNOS, CriuDriver, CriuError
from gpusnap.daemon.drivers.criu_protocol import CriuOpts, Event, Request, Result
from tests.conftest import criu_prefix, needs_pycriu


def _failed(tmp_path: Path, action: str, result: Result, log: str = "") -> CriuError:
    """What ``CriuDriver`` raises for ``result``, the last line of a helper (a process that writes that line
    and exits, standing in for criu_exec), with ``log`` as CRIU's log."""
    log_path = tmp_path / f"{action}.log"
    log_path.write_text(log)
    line = protocol.line(Event(result=result)).decode().strip()
    helper = subprocess.Popen(
        [sys.executable, "-c", f"print({line!r})"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    with pytest.raises(CriuError) as e:
        CriuDriver("criu")._exchange(helper, action, log_path, 30, None, None)
    return e.value


def test_an_answer_that_speaks_of_a_connection_is_a_failure_not_a_death(tmp_path: Path) -> None:
    """CRIU answered (cr_errno 0) with a message naming a TCP connection: CRIU refused the dump, it did not die
    (the message's words once made it CRIU_DIED, with the advice to retry)."""
    err = _failed(
        tmp_path,
        "dump",
        Result(ok=False, error="tcp: Failed to lock TCP connection"),
        "(00.2) Error (criu/sk-tcp.c:130): tcp: Failed to lock TCP connection\n",
    )
    assert err.reason == "CRIU_DUMP_FAILED" and err.code == FailedPreconditionError.code, err


@pytest.mark.parametrize("gone", sorted(CRIU_GONE_ERRNOS))
def test_criu_gone_without_answering_is_a_death(tmp_path: Path, gone: int) -> None:
    err = _failed(
        tmp_path, "restore", Result(ok=False, error=f"OSError: [Errno {gone}] {errno.errorcode[gone]}", errno=gone)
    )
    assert err.reason == "CRIU_DIED" and err.code == AbortedError.code, err


def test_a_taken_pid_is_named_by_crius_errno(tmp_path: Path) -> None:
    """A restore CRIU refuses with cr_errno EEXIST names the fix, whatever its first logged error says (here the
    benign RLIMIT_NOFILE line, as CRIU reports when it runs without CAP_SYS_RESOURCE)."""
    benign = "Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted"
    err = _failed(tmp_path, "restore", Result(ok=False, error=benign, errno=errno.EEXIST), f"(00.1) {benign}\n")
    assert err.reason == "CRIU_RESTORE_FAILED" and "restore without --host-pidns" in err.message, err


@needs_pycriu
def test_the_helper_reports_a_criu_that_ends_without_answering_as_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper's side: a CRIU that exits without a word (``true`` stands in for ``criu swrk``) gives a
    result whose errno the driver reads as CRIU gone."""
    monkeypatch.syspath_prepend(str(criu_prefix() / "python"))  # pycriu's messages (no CRIU runs)
    swrk = criu_exec.Swrk(["true"])
    req = Request(action="dump", images_dir=str(tmp_path), work_dir=str(tmp_path), opts=CriuOpts())
    result = criu_exec._run_criu(req, swrk)
    assert not result.ok and result.errno in CRIU_GONE_ERRNOS, result


def test_a_quoted_criu_log_is_never_cut_mid_word() -> None:
    """Issue 26, item 9: the quote of CRIU's log in an error was cut at 500 characters, mid-word (and the
    whole message at 1024 in the RPC's status). Now whole lines that fit, then "…"; a line too long for the
    room alone is cut after its last whole word; so is a message at the status's limit."""
    from gpusnap.daemon.api.errors import FailedPreconditionError
    from gpusnap.daemon.api.status import MAX_MESSAGE, from_status_proto, to_status_proto
    from gpusnap.daemon.drivers.criu import LOG_EXCERPT_CHARS, _joined

    lines = [
        f"({n:02}.000001) Error (criu/files-reg.c:2123): File home/user/worker/logs/w{n}.log has bad size"
        for n in range(20)
    ]
    quoted = _joined(lines, LOG_EXCERPT_CHARS)
    assert len(quoted) <= LOG_EXCERPT_CHARS and quoted.endswith(" | …"), quoted
    assert all(part in lines for part in quoted.removeprefix("CRIU log: ").removesuffix(" | …").split(" | "))
    one = _joined(["word " * 200], 100)
    assert len(one) <= 100 and one.endswith("word…"), one
    message = "and then some words " * 60 + "/home/user/models/" + "weights-" * 200
    shown = from_status_proto(to_status_proto(FailedPreconditionError(message, reason="X"))).message
    assert len(shown) <= MAX_MESSAGE and shown.endswith("…") and message.startswith(shown[:-1]), shown[-40:]
    assert shown[:-1].endswith(("words", "some", "then", "and")), shown[-40:]
