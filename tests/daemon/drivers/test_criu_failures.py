"""How a failed CRIU request is classified: by the ``errno`` the helper sends (CRIU's own ``cr_errno`` when
CRIU answered; EPIPE or ECONNRESET when CRIU went away), never by the words of CRIU's message."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.api.errors import AbortedError, FailedPreconditionError
from gpusnap.daemon.drivers import criu_exec
from gpusnap.daemon.drivers.criu import CRIU_GONE_ERRNOS, CriuDriver, CriuError
from tests.conftest import criu_prefix, needs_pycriu


def _failed(tmp_path: Path, action: str, result: dict[str, Any], log: str = "") -> CriuError:
    """What ``CriuDriver`` raises for ``result``, the last line of a helper (a process that writes that line
    and exits, standing in for criu_exec), with ``log`` as CRIU's log."""
    log_path = tmp_path / f"{action}.log"
    log_path.write_text(log)
    line = json.dumps({"event": "result", "ok": False, **result})
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
        {"error": "tcp: Failed to lock TCP connection", "errno": 0},
        "(00.2) Error (criu/sk-tcp.c:130): tcp: Failed to lock TCP connection\n",
    )
    assert err.reason == "CRIU_DUMP_FAILED" and err.code == FailedPreconditionError.code, err


@pytest.mark.parametrize("gone", sorted(CRIU_GONE_ERRNOS))
def test_criu_gone_without_answering_is_a_death(tmp_path: Path, gone: int) -> None:
    err = _failed(tmp_path, "restore", {"error": f"OSError: [Errno {gone}] {errno.errorcode[gone]}", "errno": gone})
    assert err.reason == "CRIU_DIED" and err.code == AbortedError.code, err


def test_a_taken_pid_is_named_by_crius_errno(tmp_path: Path) -> None:
    """A restore CRIU refuses with cr_errno EEXIST names the fix, whatever its first logged error says (here the
    benign RLIMIT_NOFILE line, as CRIU reports when it runs without CAP_SYS_RESOURCE)."""
    benign = "Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted"
    err = _failed(tmp_path, "restore", {"error": benign, "errno": errno.EEXIST}, f"(00.1) {benign}\n")
    assert err.reason == "CRIU_RESTORE_FAILED" and "restore without --host-pidns" in err.message, err


@needs_pycriu
def test_the_helper_reports_a_criu_that_ends_without_answering_as_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper's side: a CRIU that exits without a word (``true`` stands in for ``criu swrk``) gives a
    result whose errno the driver reads as CRIU gone."""
    monkeypatch.syspath_prepend(str(criu_prefix() / "python"))  # pycriu's messages (no CRIU runs)
    swrk = criu_exec.Swrk(["true"])
    result = criu_exec._run_criu({"action": "dump", "images_dir": str(tmp_path), "work_dir": str(tmp_path)}, swrk)
    assert not result["ok"] and result["errno"] in CRIU_GONE_ERRNOS, result
