"""Device memory filled by gpusnapd (``--gpu-prefill auto``), end to end with real CRIU on CPU: a PyTorch
worker keeps its weights in an address-stable arena over the fake VMM driver (tests/fakes/cuda_vmm.py,
whose physical allocations are memfds); gpusnapd (tests/daemon/prefill_daemon.py: the same fake for its
own driver) creates the arena's memory, fills it from the blob while CRIU restores the worker, and hands
the exported descriptors to the restored worker's agent, which maps them at the arena's addresses. The
restored worker gives identical tokens from the same address; faults in the daemon's fill or in the
worker's import fall back to today's reload; gpusnapd keeps no allocation (memfd) afterwards."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.api.errors import DataLossError
from tests.adapters import torch_venv
from tests.adapters.test_buffers_cpu import WEIGHT_BYTES, Worker
from tests.conftest import REPO, DaemonProc, kill_tree, phase_seconds, start_daemon, stop_daemon, wait_for
from tests.daemon.operations.fakes_nvml import fake_uuid

LAUNCHER = REPO / "tests" / "daemon" / "prefill_daemon.py"
GPU = fake_uuid(0)
"""prefill_daemon.py's one GPU."""
CHUNK_MIB = 64  # the 256 MiB arena in four chunks: four descriptors, copies split at chunk boundaries

pytestmark = torch_venv.needs_venv


def _daemon(tmp: Path, **env: str) -> DaemonProc:
    return start_daemon(tmp / "d", extra_env={"GPUSNAP_GPU_PREFILL": "auto", **env}, launcher=LAUNCHER)


def _memfds(pid: int) -> list[str]:
    """The fake's physical allocations gpusnapd still holds: memfd descriptors and mappings."""
    fds = [p.readlink() for p in Path(f"/proc/{pid}/fd").iterdir() if "fake-cuda-physical" in str(p.readlink())]
    maps = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "fake-cuda-physical" in line]
    return [str(f) for f in fds] + maps


def _reload_messages(d: DaemonProc, op_id: str) -> list[str]:
    return [e.message for e in d.client().watch(op_id) if e.phase == "reload-buffers" and e.message]


def _roundtrip(
    held: list[object], d: DaemonProc, tmp: Path, *worker_args: str
) -> tuple[list[str], dict[str, object], dict[str, object], Worker]:
    w = Worker(d, tmp, "w", "--stable-fake", "--chunk-mib", str(CHUNK_MIB), *worker_args)
    held.append(w)
    before = w.generate()
    dumped = json.loads(d.cli("-o", "json", "dump", str(w.proc.pid), check=True).stdout)
    assert dumped["buffer_bytes"] == WEIGHT_BYTES
    used = {u for g in d.client().get_snapshot(dumped["id"]).gpu_processes for u in g.gpu_uuids}
    assert used == {GPU}, "the worker's process used the arena's GPU at capture: the fill's security check passes"
    assert w.proc.wait(timeout=30) == -9
    op = d.client().restore(dumped["id"])
    done = d.client().wait(op.id, timeout_s=300)
    assert done.error is None, done.error
    w.restored = done.restore.pid  # type: ignore[attr-defined]
    w.phases = {p.phase: round(p.duration_seconds, 3) for p in done.phases}  # type: ignore[attr-defined]
    return _reload_messages(d, op.id), before, w.generate(), w


@pytest.fixture
def cleanup():  # type: ignore[no-untyped-def]
    held: list[object] = []  # daemons and workers
    yield held
    for x in held:
        if isinstance(x, Worker):
            kill_tree(x.proc.pid, getattr(x, "restored", 0))
    for x in held:
        if isinstance(x, DaemonProc):
            stop_daemon(x)


def test_prefilled_weights_come_back_at_the_same_address(tmp_path: Path, cleanup: list) -> None:  # type: ignore[type-arg]
    d = _daemon(tmp_path)
    cleanup.append(d)
    assert re.search(r"gpu prefill\s+on \(1 of 1 GPUs\)", d.cli("node", check=True).stdout)
    messages, before, after, w = _roundtrip(cleanup, d, tmp_path)
    assert after["ptr"] == before["ptr"], "the weights came back at the same address"
    assert after == before, "identical tokens and weights"
    assert any(f"{WEIGHT_BYTES} bytes prefilled" in m for m in messages), messages
    assert not any("read back" in m for m in messages), messages
    assert "resume restored=True resident=268435456 mapped=True" in w.events()
    assert _memfds(d.proc.pid) == [], "gpusnapd released its handles after the hand-over"
    print(f"\nMEASURED prefill on CPU (fake driver, {WEIGHT_BYTES >> 20} MiB): {w.phases}; {messages}")  # type: ignore[attr-defined]


def test_the_first_restore_after_a_checkpoint_finds_its_blob_registered(tmp_path: Path, cleanup: list) -> None:  # type: ignore[type-arg]
    """With a RAM tier, gpusnapd creates its context at start and registers the checkpoint's arena blob as
    soon as the snapshot is published, both in the background: ``gpusnap node`` says so before the first
    restore, which is prefilled."""
    d = _daemon(tmp_path, GPUSNAP_BUFFER_DIR=str(tmp_path / "ram"))
    cleanup.append(d)

    def prefill_state() -> dict[str, Any]:
        return dict(json.loads(d.cli("-o", "json", "node", check=True).stdout)["gpu_prefill"])

    wait_for(lambda: prefill_state().get("contexts") == "ready", 60, "gpusnapd's contexts were not created at start")
    assert prefill_state()["registered_bytes"] == 0, "an empty store registers nothing"
    w = Worker(d, tmp_path, "w", "--stable-fake", "--chunk-mib", str(CHUNK_MIB))
    cleanup.append(w)
    before = w.generate()
    dumped = json.loads(d.cli("-o", "json", "dump", str(w.proc.pid), check=True).stdout)
    assert w.proc.wait(timeout=30) == -9
    wait_for(
        lambda: prefill_state()["registered_bytes"] == WEIGHT_BYTES and not prefill_state()["registering"],
        60,
        "the checkpoint's blob was not registered ahead",
    )
    op = d.client().restore(dumped["id"])
    done = d.client().wait(op.id, timeout_s=300)
    assert done.error is None, done.error
    w.restored = done.restore.pid  # type: ignore[attr-defined]
    assert any(f"{WEIGHT_BYTES} bytes prefilled" in m for m in _reload_messages(d, op.id))
    assert w.generate() == before


@pytest.mark.parametrize(
    ("where", "fault", "expect"),
    [
        ("daemon", "cuMemcpyAsync:3", "cuMemcpyAsync failed"),  # mid-fill: two pieces copied already
        ("daemon", "cuMemExportToShareableHandle:2", "cuMemExportToShareableHandle failed"),
        ("worker", "cuMemImportFromShareableHandle", "did not map them"),
    ],
)
def test_a_failed_prefill_falls_back_to_the_reload(
    tmp_path: Path,
    cleanup: list,  # type: ignore[type-arg]
    where: str,
    fault: str,
    expect: str,
) -> None:
    d = _daemon(tmp_path, **({"GPUSNAP_TEST_PREFILL_FAIL": fault} if where == "daemon" else {}))
    cleanup.append(d)
    messages, before, after, w = _roundtrip(
        cleanup, d, tmp_path, *(("--fake-fail", fault) if where == "worker" else ())
    )
    assert after == before, "identical tokens, weights and address after the fallback"
    assert any(expect in m for m in messages), messages
    assert any(f"{WEIGHT_BYTES} bytes read back" in m for m in messages), messages
    assert _memfds(d.proc.pid) == [], "every allocation of the failed prefill was released"


def test_too_little_device_memory_falls_back(tmp_path: Path, cleanup: list) -> None:  # type: ignore[type-arg]
    d = _daemon(tmp_path, GPUSNAP_TEST_PREFILL_CAPACITY=str(128 << 20))
    cleanup.append(d)
    messages, before, after, w = _roundtrip(cleanup, d, tmp_path)
    assert after == before
    assert any("MiB free (not promised to other restores), the arena needs 256 MiB" in m for m in messages), messages
    assert any(f"{WEIGHT_BYTES} bytes read back" in m for m in messages), messages


def test_verify_buffers_checks_digests_before_the_filled_memory_reaches_the_worker(
    tmp_path: Path,
    cleanup: list,  # type: ignore[type-arg]
) -> None:
    """A blob changed after the capture (same size: the preflight's size check passes) is caught by
    ``--verify-buffers`` before the hand-over, as on the reload path; the filled memory never reaches the
    restored worker and gpusnapd releases it."""
    d = _daemon(tmp_path)
    cleanup.append(d)
    w = Worker(d, tmp_path, "w", "--stable-fake", "--chunk-mib", str(CHUNK_MIB))
    cleanup.append(w)
    dumped = json.loads(d.cli("-o", "json", "dump", str(w.proc.pid), check=True).stdout)
    assert w.proc.wait(timeout=30) == -9
    (blob,) = [p for p in (d.store / "buffers" / "sha256").rglob("*") if p.is_file()]
    with open(blob, "r+b") as fh:
        fh.seek(WEIGHT_BYTES // 2)
        byte = fh.read(1)
        fh.seek(WEIGHT_BYTES // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    op = d.client().restore(dumped["id"], verify_buffers=True)
    with pytest.raises(DataLossError, match="buffer w: checksum mismatch"):
        d.client().wait(op.id, timeout_s=300)
    assert not any("prefilled" in m for m in _reload_messages(d, op.id)), "nothing was handed over"
    assert _memfds(d.proc.pid) == [], "the filled memory was released"


def test_a_standby_activates_with_prefilled_weights_and_the_same_tokens(tmp_path: Path, cleanup: list) -> None:  # type: ignore[type-arg]
    """``gpusnap standby`` restores the worker ahead (stopped, its agent quiesced, its RAM-tier blob
    registered for the fill); ``gpusnap activate`` wakes it, hands it the arena gpusnapd filled, resumes it
    and checks its canary: the same tokens from the same address as before the capture."""
    d = _daemon(tmp_path, GPUSNAP_BUFFER_DIR=str(tmp_path / "ram"))
    cleanup.append(d)
    w = Worker(d, tmp_path, "w", "--stable-fake", "--chunk-mib", str(CHUNK_MIB))
    cleanup.append(w)
    before = w.generate()
    d.cli("dump", str(w.proc.pid), "--name", "w", check=True)
    assert w.proc.wait(timeout=30) == -9
    (sb,) = json.loads(d.cli("-o", "json", "standby", "w", check=True, timeout=300).stdout)["standbys"]
    w.restored = sb["pid"]  # type: ignore[attr-defined]
    registered = f"{WEIGHT_BYTES / 2**30:.1f} GiB of blobs registered"
    wait_for(lambda: registered in d.cli("node", check=True).stdout, 60, "the standby's blob was not registered")
    assert "resume" not in w.events()[-1], "the standby's worker has not resumed"
    done = json.loads(d.cli("-o", "json", "activate", sb["id"], check=True, timeout=300).stdout)
    assert done["pid"] == sb["pid"] and list(phase_seconds(done))[:2] == ["preflight", "wake"]
    assert any(f"{WEIGHT_BYTES} bytes prefilled" in m for m in _reload_messages(d, done["operation"]))
    assert w.generate() == before, "identical tokens, weights and address"
    assert _memfds(d.proc.pid) == [], "gpusnapd released its handles after the hand-over"
