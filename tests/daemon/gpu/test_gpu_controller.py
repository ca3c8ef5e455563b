"""GpuTreeController: exact driver call order and final states, with faults at every step (fake CUDA driver)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import DeadlineExceededError, FailedPreconditionError, NotFoundError
from gpusnap.daemon.drivers.cuda import CudaCheckpointApi, CudaError, CudaResult, ProcessState
from gpusnap.daemon.gpu.controller import GpuTreeController, StepTiming, suggest_transfer_timeout_s
from tests.fakes.cuda import FakeCudaApi, FakeProc

R, L, C, F = ProcessState.RUNNING, ProcessState.LOCKED, ProcessState.CHECKPOINTED, ProcessState.FAILED
PIDS = [101, 102, 103]
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    fake = FakeProc(tmp_path / "proc")
    for pid in [*PIDS, 104]:
        fake.add(pid)
    return fake


@pytest.fixture
def api(proc: FakeProc) -> Iterator[FakeCudaApi]:
    fake = FakeCudaApi(PIDS, proc_root=proc.root)
    yield fake
    fake.release_all()


def make(api: FakeCudaApi, proc: FakeProc, **kw: float) -> GpuTreeController:
    return GpuTreeController(api, call_timeout_s=kw.get("call_timeout_s", 2.0), proc_root=proc.root)


def states(api: FakeCudaApi, pids: list[int] = PIDS) -> list[ProcessState]:
    return [api.state(p) for p in pids]


def capture(
    ctl: GpuTreeController, pids: list[int], lock_timeout_ms: int, tree_pids: Sequence[int] = ()
) -> list[StepTiming]:
    """A checkpoint's GPU phases as ``operations.checkpoint`` runs them: lock → checkpoint → the dump check, and,
    when the dump check fails, its ``gpu-rollback`` undo (``rollback_to_running``, raising what it could not do)."""
    steps = [ctl.lock_all(pids, lock_timeout_ms), ctl.checkpoint_all(pids)]
    try:
        steps.append(ctl.assert_ready_for_dump(pids, tree_pids))
    except BaseException:
        ctl.rollback_to_running(pids).raise_for_problems()
        raise
    return steps


def bring_up(ctl: GpuTreeController, pids: list[int], gpu_pairs: Sequence[tuple[str, str]] = ()) -> list[StepTiming]:
    """A restore's GPU phases after CRIU, as ``operations.restore.bring_up`` runs them: restore → unlock → verify."""
    return [ctl.restore_all(pids, gpu_pairs), ctl.unlock_all(pids), ctl.verify_running(pids)]


def test_fake_satisfies_protocol(api: FakeCudaApi) -> None:
    assert isinstance(api, CudaCheckpointApi)


def test_fake_rejects_illegal_transitions(api: FakeCudaApi) -> None:
    with pytest.raises(CudaError) as e:
        api.checkpoint(101)
    assert e.value.result_name == "CUDA_ERROR_ILLEGAL_STATE" and api.state(101) == R
    with pytest.raises(CudaError):
        api.unlock(101)
    api.lock(101, 0)
    with pytest.raises(CudaError):
        api.lock(101, 0)
    with pytest.raises(CudaError) as e:
        api.get_state(999)
    assert e.value.result_name == "CUDA_ERROR_INVALID_VALUE"
    failed = FakeCudaApi({7: F})
    calls: list[Callable[[], None]] = [
        lambda: failed.lock(7, 0),
        lambda: failed.checkpoint(7),
        lambda: failed.restore(7),
        lambda: failed.unlock(7),
    ]
    for call in calls:
        with pytest.raises(CudaError):
            call()
    assert failed.state(7) == F


# ---------------------------------------------------------------------------------------------- happy path


def test_happy_path_capture_resume_restore(api: FakeCudaApi, proc: FakeProc) -> None:
    ctl = make(api, proc)
    steps = capture(ctl, PIDS, 5000, tree_pids=[104])
    assert [s.step for s in steps] == ["lock", "checkpoint", "verify_dump"]
    assert all(isinstance(s, StepTiming) and s.seconds >= 0 for s in steps)
    assert set(steps[0].per_pid) == set(PIDS)
    assert api.sequence() == [
        ("lock", 101), ("lock", 102), ("lock", 103),
        ("checkpoint", 101), ("checkpoint", 102), ("checkpoint", 103),
        ("get_state", 101), ("get_state", 102), ("get_state", 103),
    ]  # fmt: skip
    assert api.calls[0].args == (5000,)
    assert states(api) == [C, C, C]

    # leave-running: resume the source after the dump
    api.calls.clear()
    rb = ctl.rollback_to_running(PIDS)
    assert rb.ok, rb.summary()
    assert api.sequence() == [
        ("get_state", 101), ("get_state", 102), ("get_state", 103),
        ("restore", 101), ("restore", 102), ("restore", 103),
        ("unlock", 101), ("unlock", 102), ("unlock", 103),
    ]  # fmt: skip
    assert states(api) == [R, R, R]

    # restore path (as after a CRIU restore): restore(pairs) -> unlock -> verify (FC-09 order)
    capture(ctl, PIDS, 5000)
    api.calls.clear()
    steps = bring_up(ctl, PIDS)
    assert [s.step for s in steps] == ["restore", "unlock", "verify"]
    assert api.sequence() == [
        ("restore", 101), ("restore", 102), ("restore", 103),
        ("unlock", 101), ("unlock", 102), ("unlock", 103),
        ("get_state", 101), ("get_state", 102), ("get_state", 103),
    ]  # fmt: skip
    assert states(api) == [R, R, R]


def test_restore_passes_gpu_pairs_and_remaps(proc: FakeProc) -> None:
    api = FakeCudaApi({101: C}, gpus={101: [GPU_A]})
    ctl = make(api, proc)
    bring_up(ctl, [101], [(GPU_A, GPU_B)])
    assert api.calls[0] == api.calls[0].__class__("restore", 101, (((GPU_A, GPU_B),),))
    assert api.gpus_of[101] == [GPU_B]
    assert api.sequence() == [("restore", 101), ("unlock", 101), ("get_state", 101)]


def test_find_cuda_pids(api: FakeCudaApi, proc: FakeProc) -> None:
    ctl = make(api, proc)
    assert ctl.find_cuda_pids([101, 104, 102, 101]) == [101, 102]
    assert ctl.find_cuda_pids([101, 104], nvml_pids={101}) == [101]
    with pytest.raises(FailedPreconditionError) as e:
        ctl.find_cuda_pids([101, 104], nvml_pids={104})
    assert e.value.reason == "GPU_PROCESS_NOT_CHECKPOINTABLE" and "104" in e.value.message


# ---------------------------------------------------------------------------------------------- lock faults


def test_lock_failure_on_second_rolls_back_first(api: FakeCudaApi, proc: FakeProc) -> None:
    api.fail("lock", 102, result=CudaResult.CUDA_ERROR_UNKNOWN)
    ctl = make(api, proc)
    with pytest.raises(CudaError) as e:
        ctl.lock_all(PIDS, 1000)
    assert api.sequence() == [("lock", 101), ("lock", 102), ("unlock", 101), ("get_state", 102)]
    assert states(api) == [R, R, R]
    msg = e.value.message
    assert "cuCheckpointProcessLock(pid=102)" in msg and "lock failed at pid 102" in msg and "unlock(101)" in msg
    assert "all 2 process(es) RUNNING" in msg
    assert e.value.metadata["rollback"] == "ok" and e.value.metadata["stranded_pids"] == ""


def test_lock_timeout_leaves_running(api: FakeCudaApi, proc: FakeProc) -> None:
    api.lock_timeout(103)
    with pytest.raises(CudaError) as e:
        make(api, proc).lock_all(PIDS, 250)
    assert e.value.result == CudaResult.CUDA_ERROR_NOT_READY
    assert "lock timed out" in e.value.message
    assert api.sequence() == [
        ("lock", 101),
        ("lock", 102),
        ("lock", 103),
        ("unlock", 102),
        ("unlock", 101),
        ("get_state", 103),
    ]
    assert states(api) == [R, R, R]


def test_hung_lock_fc02_group_rollback_and_late_unlock(api: FakeCudaApi, proc: FakeProc) -> None:
    release = api.hang("lock", 102)
    ctl = make(api, proc, call_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError) as e:
        ctl.lock_all(PIDS, 100)
    assert time.monotonic() - t0 < 3
    assert "cuCheckpointProcessLock(pid=102) did not return within 0.4 s" in e.value.message
    assert e.value.reason == "DRIVER_CALL_TIMEOUT"
    assert api.sequence() == [("lock", 101), ("lock", 102), ("unlock", 101), ("get_state", 102)]
    assert states(api) == [R, R, R]
    # The hung lock completes later: the controller's compensating unlock runs in the abandoned thread.
    release.set()
    deadline = time.monotonic() + 5
    while not ctl.late_actions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ctl.late_actions == ["late lock(102) succeeded after its deadline: unlocked"]
    assert states(api) == [R, R, R]


def test_lock_rollback_unlock_fails_reports_stranded(api: FakeCudaApi, proc: FakeProc) -> None:
    api.fail("lock", 103)
    api.fail("unlock", 101, count=None)
    with pytest.raises(CudaError) as e:
        make(api, proc).lock_all(PIDS, 1000)
    assert states(api) == [L, R, R]
    assert e.value.metadata["rollback"] == "incomplete"
    assert e.value.metadata["stranded_pids"] == "101"
    assert "pid 101: unlock failed" in e.value.message and "kill the worker tree" in e.value.message


def test_target_dies_during_lock_fc13(api: FakeCudaApi, proc: FakeProc) -> None:
    api.die("lock", 102)
    with pytest.raises(CudaError) as e:
        make(api, proc).lock_all(PIDS, 1000)
    assert "Target process 102 is gone" in e.value.message and "FC-13" in e.value.message
    assert api.state(101) == R


# ---------------------------------------------------------------------------------------------- checkpoint faults


def test_checkpoint_not_supported_unlocks_fc15(proc: FakeProc) -> None:
    api = FakeCudaApi([101])
    api.not_supported("checkpoint", 101)
    ctl = make(api, proc)
    ctl.lock_all([101], 1000)
    with pytest.raises(CudaError) as e:
        ctl.checkpoint_all([101])
    assert api.sequence() == [("lock", 101), ("checkpoint", 101), ("get_state", 101), ("unlock", 101)]
    assert api.state(101) == R
    assert e.value.result == 801 and e.value.result_name == "CUDA_ERROR_NOT_SUPPORTED"
    assert "x86-64" in e.value.message and "driver" in e.value.message
    assert e.value.call == "cuCheckpointProcessCheckpoint" and e.value.pid == 101


def test_checkpoint_failure_on_second_restores_first_unlocks_rest(api: FakeCudaApi, proc: FakeProc) -> None:
    api.fail("checkpoint", 102, result=CudaResult.CUDA_ERROR_OUT_OF_MEMORY)
    ctl = make(api, proc)
    with pytest.raises(CudaError) as e:
        capture(ctl, PIDS, 1000)
    assert api.sequence() == [
        ("lock", 101), ("lock", 102), ("lock", 103),
        ("checkpoint", 101), ("checkpoint", 102),
        ("get_state", 101), ("get_state", 102), ("get_state", 103),
        ("restore", 101),
        ("unlock", 101), ("unlock", 102), ("unlock", 103),
    ]  # fmt: skip
    assert states(api) == [R, R, R]
    assert "restore(101), unlock(101), unlock(102), unlock(103)" in e.value.message


def test_hung_checkpoint_deadline_fc03(api: FakeCudaApi, proc: FakeProc) -> None:
    api.hang("checkpoint", 102)
    ctl = GpuTreeController(api, call_timeout_s=1.0, transfer_timeout_s=0.3, proc_root=proc.root)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError) as e:
        capture(ctl, PIDS, 1000)
    assert time.monotonic() - t0 < 5
    msg = e.value.message
    assert "cuCheckpointProcessCheckpoint(pid=102) did not return within 0.3 s" in msg
    assert "do not retry blindly" in msg and "checkpoint failed at pid 102" in msg
    # 101 was checkpointed -> restored + unlocked; 102 (call still hung, state LOCKED in the fake) and 103 unlocked
    assert states(api) == [R, R, R]


def test_device_files_after_checkpoint_abort_and_resume_fc16(api: FakeCudaApi, proc: FakeProc) -> None:
    proc.add(102, fds=["/dev/null", "/dev/nvidia0", "/dev/nvidiactl"])
    ctl = make(api, proc)
    with pytest.raises(FailedPreconditionError) as e:
        capture(ctl, PIDS, 1000)
    assert e.value.reason == "GPU_DEVICE_FILES_OPEN"
    assert "process 102" in e.value.message and "/dev/nvidia0" in e.value.message
    assert states(api) == [R, R, R], "the gpu-rollback undo brought every process back"


def test_assert_no_device_files(proc: FakeProc, api: FakeCudaApi) -> None:
    ctl = make(api, proc)
    proc.add(201, fds=["/dev/null", "socket:[1234]", "/tmp/x"], maps=["/dev/shm/nccl-abc"])
    ctl.assert_no_device_files(201)
    proc.add(202, maps=["/dev/nvidia-uvm"])
    with pytest.raises(FailedPreconditionError) as e:
        ctl.assert_no_device_files(202)
    assert "/dev/nvidia-uvm" in e.value.message and e.value.metadata["pid"] == "202"
    # explicit proc_root parameter
    other = FakeProc(proc.root.parent / "other")
    other.add(202)
    ctl.assert_no_device_files(202, proc_root=other.root)
    with pytest.raises(NotFoundError):
        ctl.assert_no_device_files(999)


def test_assert_ready_for_dump_requires_checkpointed(api: FakeCudaApi, proc: FakeProc) -> None:
    ctl = make(api, proc)
    ctl.lock_all(PIDS, 1000)
    with pytest.raises(FailedPreconditionError) as e:
        ctl.assert_ready_for_dump(PIDS)
    assert e.value.reason == "CUDA_NOT_CHECKPOINTED" and "101 is LOCKED" in e.value.message


# ---------------------------------------------------------------------------------------------- restore faults


def test_restore_silently_leaves_checkpointed_fc18(proc: FakeProc) -> None:
    api = FakeCudaApi({101: C, 102: C})
    api.noop("restore", 102)  # the call "succeeds" but nothing happens
    ctl = make(api, proc)
    with pytest.raises(CudaError) as e:
        bring_up(ctl, [101, 102])
    assert api.sequence() == [("restore", 101), ("restore", 102), ("unlock", 101), ("unlock", 102), ("get_state", 102)]
    assert e.value.result_name == "CUDA_ERROR_ILLEGAL_STATE"
    assert "102 (CHECKPOINTED)" in e.value.message and e.value.metadata["stranded_pids"] == "102"
    assert api.state(101) == R and api.state(102) == C


def test_verify_running_names_pid_and_state(proc: FakeProc) -> None:
    api = FakeCudaApi({101: R, 102: C, 103: L})
    with pytest.raises(FailedPreconditionError) as e:
        make(api, proc).verify_running([101, 102, 103])
    assert e.value.reason == "CUDA_NOT_RUNNING"
    assert "102 (CHECKPOINTED)" in e.value.message and "103 (LOCKED)" in e.value.message
    assert "FC-18" in e.value.message and "keep the image" in e.value.message
    assert e.value.metadata["not_running"] == "102,103"


def test_verify_running_missing_process(proc: FakeProc) -> None:
    api = FakeCudaApi({101: R, 105: R})
    with pytest.raises(FailedPreconditionError) as e:
        make(api, proc).verify_running([101, 105])  # 105 has no /proc entry
    assert e.value.reason == "PROCESS_MISSING" and e.value.metadata["missing_pids"] == "105"
    proc.add(106, state="Z")
    api.states[106] = R
    with pytest.raises(FailedPreconditionError):
        make(api, proc).verify_running([106])  # zombie counts as missing


def test_restore_failure_reports_restored_and_pending(proc: FakeProc) -> None:
    api = FakeCudaApi({101: C, 102: C, 103: C}, gpus={101: [GPU_A], 102: [GPU_A, GPU_B], 103: [GPU_A]})
    ctl = make(api, proc)
    with pytest.raises(CudaError) as e:
        ctl.restore_all(PIDS, [(GPU_A, GPU_B)])  # incomplete for 102 (FC-08)
    assert e.value.result_name == "CUDA_ERROR_INVALID_VALUE"
    assert e.value.metadata["restored_pids"] == "101" and e.value.metadata["pending_pids"] == "103"
    assert "release_gpus_for_kill" in e.value.message
    assert [api.state(p) for p in PIDS] == [L, C, C]


def test_unlock_all_tolerates_error_when_running(proc: FakeProc) -> None:
    api = FakeCudaApi({101: R, 102: L})
    api.fail("unlock", 101, result=CudaResult.CUDA_ERROR_ILLEGAL_STATE)
    ctl = make(api, proc)
    ctl.unlock_all([101, 102])  # 101's unlock fails but it reads RUNNING -> tolerated (as Dynamo does)
    assert api.sequence() == [("unlock", 101), ("get_state", 101), ("unlock", 102)]
    assert api.state(102) == R


def test_unlock_all_continues_past_failure(proc: FakeProc) -> None:
    api = FakeCudaApi({101: L, 102: L})
    api.fail("unlock", 101, count=None)
    with pytest.raises(CudaError) as e:
        make(api, proc).unlock_all([101, 102])
    assert api.state(102) == R and api.state(101) == L
    assert e.value.metadata["stranded_pids"] == "101"


# ---------------------------------------------------------------------------------------------- rollback


def test_rollback_from_mixed_states(proc: FakeProc) -> None:
    proc.add(104)
    api = FakeCudaApi({101: R, 102: L, 103: C, 104: F})
    result = make(api, proc).rollback_to_running([101, 102, 103, 104])
    assert api.sequence() == [
        ("get_state", 101), ("get_state", 102), ("get_state", 103), ("get_state", 104),
        ("restore", 103),
        ("unlock", 102), ("unlock", 103),
    ]  # fmt: skip
    assert [api.state(p) for p in (101, 102, 103)] == [R, R, R]
    assert not result.ok and result.stranded == [104]
    assert result.states == {101: R, 102: R, 103: R, 104: F}
    assert any("pid 104" in p and "FAILED is terminal" in p for p in result.problems)
    with pytest.raises(FailedPreconditionError) as e:
        result.raise_for_problems()
    assert e.value.reason == "GPU_ROLLBACK_INCOMPLETE" and e.value.metadata["stranded_pids"] == "104"


def test_rollback_restore_failure_reported(proc: FakeProc) -> None:
    api = FakeCudaApi({101: C, 102: L})
    api.fail("restore", 101)
    result = make(api, proc).rollback_to_running([101, 102])
    assert api.state(102) == R and api.state(101) == C
    assert result.stranded == [101]
    assert "pid 101: restore failed" in result.summary() and "original GPUs" in result.summary()


def test_rollback_unknown_state(proc: FakeProc) -> None:
    api = FakeCudaApi({101: L})
    api.fail("get_state", 101)
    result = make(api, proc).rollback_to_running([101])
    assert result.states == {101: None} and not result.ok
    assert "state unknown" in result.problems[0]


# ---------------------------------------------------------------------------------------------- kill path (FC-12)


def test_release_gpus_for_kill(proc: FakeProc) -> None:
    api = FakeCudaApi({101: R, 102: L, 103: C})
    result = make(api, proc).release_gpus_for_kill(PIDS, lock_timeout_ms=1000)
    assert api.sequence() == [
        ("get_state", 101), ("lock", 101), ("checkpoint", 101),
        ("get_state", 102), ("checkpoint", 102),
        ("get_state", 103),
    ]  # fmt: skip
    assert result.ok and states(api) == [C, C, C]


def test_release_gpus_for_kill_reports_failure(proc: FakeProc) -> None:
    api = FakeCudaApi({101: R})
    api.not_supported("checkpoint", 101)
    result = make(api, proc).release_gpus_for_kill([101], lock_timeout_ms=1000)
    assert not result.ok and result.states == {101: L}
    assert "checkpoint failed" in result.problems[0]


def test_suggest_transfer_timeout() -> None:
    assert suggest_transfer_timeout_s(0) == 60.0
    assert suggest_transfer_timeout_s(int(16e9)) == pytest.approx(92.0)


def test_controller_rejects_bad_timeout(api: FakeCudaApi) -> None:
    with pytest.raises(ValueError):
        GpuTreeController(api, call_timeout_s=0)
