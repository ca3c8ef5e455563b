"""Device memory filled by gpusnapd (``--gpu-prefill auto``) on a real GPU (``make test-gpu``).

A PyTorch worker (torch_worker.py ``--agent --stable``) keeps ``GPUSNAP_TEST_GIB`` GiB in an address-stable
arena and has captured a CUDA graph that reads it. After dump → restore through a daemon with prefill on
(its context created at start, the snapshot's blob registered ahead after the checkpoint), the reload-buffers phase reports every byte prefilled (none read back), the pattern checksum and both
graphs' outputs equal those at start, and the canary (the pattern checksum) passed. The CPU tests of the
same path, faults and fallbacks included, are tests/adapters/test_prefill_cpu.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import kill_tree, start_daemon, stop_daemon, wait_for
from tests.gpu.test_gpu import GIB
from tests.shortdirs import short_dir

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).resolve().parent / "torch_worker.py"


def test_prefilled_arena_and_its_graph_survive_dump_and_restore(tmp_path: Path) -> None:
    buffers = short_dir("gpusnap-prefill-", 0o700, "/dev/shm")  # a RAM tier, as in production
    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_GPU_PREFILL": "auto", "GPUSNAP_BUFFER_DIR": str(buffers)})
    wd = tmp_path / "w"
    wd.mkdir()
    env = {**os.environ, "GPUSNAP_AGENT_SOCKET": str(d.agent_socket), "GPUSNAP_WAKE_DIR": str(tmp_path / "wake")}
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(wd), "--gib", str(GIB), "--agent", "--stable"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(wd / "stderr", "wb"),
        env=env,
        start_new_session=True,
    )
    restored = 0
    try:
        assert re.search(r"gpu prefill\s+on", d.cli("node", check=True).stdout), d.cli("node").stdout
        wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 300, "torch worker did not start")
        assert proc.poll() is None, (wd / "stderr").read_text()
        expected = (wd / "expected").read_text().split()
        assert len(expected) == 3, "pattern checksum, graph output, weights graph output"
        dumped = json.loads(d.cli("-o", "json", "dump", str(proc.pid), check=True, timeout=900).stdout)
        assert dumped["buffer_bytes"] == int(GIB * 2**30)
        assert proc.wait(timeout=60) == -signal.SIGKILL

        def state() -> dict[str, Any]:
            return dict(json.loads(d.cli("-o", "json", "node", check=True).stdout)["gpu_prefill"])

        # gpusnapd created its context at start and registers the new snapshot's blob in the background
        wait_for(lambda: state()["registered_bytes"] > 0 and not state()["registering"], 120, str(state()))
        assert state().get("contexts") == "ready", state()
        op = d.client().restore(dumped["id"])
        done = d.client().wait(op.id, timeout_s=900)
        assert done.error is None and done.restore is not None, done.error
        restored = done.restore.pid
        messages = [e.message for e in d.client().watch(op.id) if e.phase == "reload-buffers" and e.message]
        assert any(f"{dumped['buffer_bytes']} bytes prefilled" in m for m in messages), messages
        assert not any("read back" in m for m in messages), messages
        now = wd / "now"
        now.unlink(missing_ok=True)
        os.kill(restored, signal.SIGUSR1)
        wait_for(now.exists, 120, "the restored worker did not answer")
        assert now.read_text().split()[:3] == expected, "same bytes, same graph outputs (same addresses)"
        phases = {p.phase: round(p.duration_seconds, 3) for p in done.phases}
        print(f"\nMEASURED prefill restore of {GIB} GiB: {phases}; {messages}")
    finally:
        kill_tree(proc.pid, restored)
        stop_daemon(d)
        subprocess.run(["rm", "-rf", str(buffers)], check=False)
