"""Generate gpusnap's gRPC stubs from proto/ into daemon/_proto, and the agent channel's messages into
adapters/contract/_proto (run by `make proto`).

protoc writes modules for package `gpusnap.v1`; they are moved into the private packages
`gpusnap.daemon._proto` and `gpusnap.adapters.contract._proto` and their module names rewritten, so the
generated code never claims a top-level name. Output is committed; never edit it by hand.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "daemon" / "_proto"
PACKAGE = "gpusnap.daemon._proto"
# The agent channel is used inside worker processes: its module lives in the adapters' contract package.
AGENT_OUT_DIR = ROOT / "adapters" / "contract" / "_proto"
AGENT_PACKAGE = "gpusnap.adapters.contract._proto"
AGENT_MODULES = ("agent_pb2.py", "agent_pb2.pyi")


def _include_dirs() -> list[str]:
    """Proto include paths: ours, protobuf's well-known types, googleapis' google/rpc."""
    dirs = [str(PROTO_DIR), str(Path(grpc_tools.__file__).parent / "_proto")]
    for entry in sys.path:
        if (Path(entry) / "google" / "rpc" / "status.proto").exists():
            dirs.append(entry)
            break
    else:
        raise SystemExit("google/rpc/status.proto not found: install googleapis-common-protos")
    return dirs


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        bindir = Path(sys.executable).parent
        args = ["protoc", *(f"-I{d}" for d in _include_dirs())]
        args += [
            f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        ]
        args += [f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--mypy_out={tmp}", f"--mypy_grpc_out={tmp}"]
        if protoc.main([*args, *protos]) != 0:
            return 1
        for out in (OUT_DIR, AGENT_OUT_DIR):
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
        for src in sorted((Path(tmp) / "gpusnap" / "v1").iterdir()):
            if src.name.startswith("agent_pb2_grpc"):
                continue  # the agent channel is not gRPC
            agent = src.name in AGENT_MODULES
            package = AGENT_PACKAGE if agent else PACKAGE  # the module's own name, as it registers its messages
            text = re.sub(r"\bfrom gpusnap\.v1 import\b", f"from {package} import", src.read_text())
            text = re.sub(r"\bimport gpusnap\.v1\.(\w+)", rf"import {package}.\1", text)
            text = re.sub(r"\bgpusnap\.v1\.(\w+_pb2)\b", rf"{package}.\1", text)
            dest = AGENT_OUT_DIR if agent else OUT_DIR
            (dest / src.name).write_text(text)
    (OUT_DIR / "__init__.py").write_text(
        '"""Generated gRPC code for gpusnap.v1 (scripts/gen_protos.py). Do not edit."""\n'
    )
    (AGENT_OUT_DIR / "__init__.py").write_text(
        '"""Generated agent-channel messages (scripts/gen_protos.py). Do not edit."""\n'
    )
    print(f"generated {len(protos)} protos into {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
