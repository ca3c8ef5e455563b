"""Issue 19, item 8: a worker's descriptors for its buffers must not let it grow the buffer store.

A capture with offload handed the worker a read-write descriptor of the buffer store's own staged file,
which became the blob: a worker that kept it (or passed it on) could write past the announced size during
or after its capture and fill the RAM tier or the disk under the store beyond every budget. The worker
now writes into sealed memfds that gpusnapd copies (gpusnap.daemon.store.sealed).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import DaemonProc, _cli_env, kill_tree, wait_for
from tests.users import User

LEAKY = Path(__file__).with_name("leaky_agent.py")
SIZE = 1 << 20
GROW = 16 << 20
WRITE_PAST_END = """
import os, sys
try:
    os.pwrite(int(sys.argv[1]), b"x" * int(sys.argv[3]), int(sys.argv[2]))
    print("wrote")
except OSError as exc:
    print(exc.errno)
"""


def _blob_sizes(d: DaemonProc) -> list[int]:
    return sorted(p.stat().st_size for p in (d.store / "buffers" / "sha256").rglob("*") if p.is_file())


def test_descriptors_a_worker_kept_cannot_grow_the_buffer_store(
    daemon: DaemonProc, tmp_path: Path, hostile: tuple[User, User]
) -> None:
    """The worker passes its Offload descriptor to an accomplice, an unprivileged user outside the tree,
    who writes 16 MiB past the buffer's end once the snapshot is published. Before: the write landed in the
    blob (1 MiB -> 17 MiB, whatever the budgets). Now: EPERM, the blob keeps its size and bytes.

    The worker runs as root: CRIU cannot dump another user's tree on these machines (no CAP_SYS_RESOURCE),
    and the descriptor's rights do not depend on its holder's uid (the accomplice's is a user's)."""
    accomplice, _ = hostile
    (tmp_path / "wake").mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "accomplice.sock"))
    listener.listen(4)
    out = tmp_path / "leaky.out"
    worker = subprocess.Popen(
        [
            sys.executable,
            str(LEAKY),
            str(daemon.agent_socket),
            str(tmp_path / "wake"),
            str(tmp_path / "accomplice.sock"),
            str(SIZE),
        ],
        stdin=subprocess.DEVNULL,
        stdout=out.open("wb"),
        stderr=subprocess.STDOUT,
        env=_cli_env(),
        start_new_session=True,
    )
    try:
        wait_for(lambda: "ready" in out.read_text() or worker.poll() is not None, 30, "the worker did not attach")
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(worker.pid), "--name", "leaky", check=True).stdout)
        assert dumped["buffer_bytes"] == SIZE
        listener.settimeout(10)
        conn, _ = listener.accept()
        _, fds, _, _ = socket.recv_fds(conn, 16, 4)
        conn.close()
        assert len(fds) == 1, "the worker got one descriptor, for its one buffer"
        assert _blob_sizes(daemon) == [SIZE]
        res = subprocess.run(
            [*accomplice.argv(), sys.executable, "-c", WRITE_PAST_END, str(fds[0]), str(SIZE), str(GROW)],
            pass_fds=fds,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.stdout.strip() == "1", f"a write past the announced size: {res.stdout or res.stderr}"
        assert _blob_sizes(daemon) == [SIZE], "the blob did not grow"
        (blob,) = [p for p in (daemon.store / "buffers" / "sha256").rglob("*") if p.is_file()]
        assert blob.read_bytes() == b"\x5a" * SIZE, "the blob holds what the worker wrote at capture"
    finally:
        listener.close()
        kill_tree(worker.pid)
