"""What the CLI loads to start: ``gpusnap --version`` and ``--help`` (of the group and of a command) load
neither gRPC nor protobuf nor rich, and the client's values load without gRPC (docs/performance.md, "The
CLI's start")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("grpc", "google.protobuf", "gpusnap.daemon._proto", "rich", "gpusnap.daemon.client.calls")

_RUN = """
import json, sys
from gpusnap.daemon.cli import main
try:
    main.main(args=sys.argv[1:], prog_name="gpusnap")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in sys.modules if m.startswith(%r))}))
"""


def _start(*args: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _RUN % (HEAVY,), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["restore", "--help"], ["dump", "--help"]])
def test_version_and_help_load_no_grpc(args: list[str]) -> None:
    started = _start(*args)
    assert started == {"code": 0, "heavy": []}, started


def test_the_client_values_load_without_grpc_and_the_client_on_first_use() -> None:
    code = (
        "import sys, json\n"
        "import gpusnap.daemon.client.values\n"
        "before = sorted(m for m in sys.modules if m.startswith('grpc'))\n"
        "from gpusnap.daemon.client import DaemonClient, OperationHandle, raise_if_failed\n"
        "print(json.dumps([before, DaemonClient.__module__, 'grpc' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == [[], "gpusnap.daemon.client.calls", True]
