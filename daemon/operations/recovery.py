"""Recovery at start: finish every operation a crashed daemon left half-done, from its journal entry.

- checkpoint: a CRIU the crashed daemon started that still dumps is waited for first
  (:mod:`~gpusnap.daemon.operations.leftover_criu`): the operation runs on, holding the tree, until it is
  gone, and nothing below happens before. Then the source comes back. Stopped processes of its tree are continued, CUDA processes are
  restored and unlocked (``rollback_to_running``), a quiesced worker is woken, given back the buffers it had
  written out (staged files, kept when the buffer store opened: :func:`held_buffers`, or their committed
  blobs) and resumed, a control-directory
  worker gets ``restore-complete``; staging was removed when the store opened. A snapshot published before
  the crash is complete and durable and stays listed: the operation then succeeded, with its source left
  running instead of stopped.
- restore and activate (of a standby): a tree that CRIU brought back and ``validate`` accepted is adopted:
  its worker is resumed in a new run reported under the original operation id. A tree that had not passed
  ``validate`` has its GPUs released and is killed. The operation's message says which.
- standby: the copy being made is killed; copies registered before the crash are standbys (the registry,
  ``gpusnap.daemon.park.standbys``, adopts them after recovery).
- Finally, every CUDA process of the journal's trees that is found LOCKED or CHECKPOINTED (and that no
  successful suspend left so on purpose) is restored and unlocked.

Finished entries become finished operations again, so ``GetOperation`` and retries of an idempotency key
get the original outcome across the restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import structlog

from gpusnap.daemon.api.errors import AbortedError, Code, GpusnapError, error_for_code
from gpusnap.daemon.api.types import RestoreOptions, RestoreResult, Snapshot
from gpusnap.daemon.drivers import proc, restored
from gpusnap.daemon.drivers.cuda import ProcessState
from gpusnap.daemon.operations import leftover_criu, workers
from gpusnap.daemon.operations.base import OperationKind, OperationRecord, OperationState, PhaseRunner
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.operations.registry import OperationRegistry
from gpusnap.daemon.store import facts as journaled
from gpusnap.daemon.store.buffers import HeldFiles
from gpusnap.daemon.store.facts import CaptureFacts, Facts, JournaledTree, RestoreFacts
from gpusnap.daemon.store.journal import Entry, Journal
from gpusnap.daemon.workers import controldir

log = structlog.get_logger(__name__)


def recover(deps: Deps, journal: Journal, registry: OperationRegistry) -> list[OperationRecord]:
    """Recover every unfinished journal entry and re-register the finished ones; returns the recovered."""
    recovered = []
    suspended: set[int] = set()
    stray_cuda: set[int] = set()
    kept: tuple[list[Path], list[str]] = ([], [])
    for entry in journal.entries():
        kind = entry.kind
        record = _record(entry)
        if record is None:  # its facts do not read as its kind's: say so (journal.facts_unreadable), go on
            continue
        if not entry.running:
            _restore_result(deps, record, entry)
            registry.adopt(record)
            if kind is OperationKind.SUSPEND and record.state is OperationState.SUCCEEDED:
                suspended.add(record.target_pid)
            elif kind is OperationKind.RESUME and record.state is OperationState.SUCCEEDED:
                suspended.discard(record.target_pid)
            continue
        facts = record.facts
        record.journal = journal
        log.warning("recovery.operation", operation_id=record.id, kind=kind.value, phase=record.phase)
        if kind is OperationKind.CHECKPOINT and isinstance(facts, CaptureFacts) and leftover_criu.running(facts):
            _after_leftover_criu(deps, registry, record, facts)  # its CUDA processes and buffers are its own
            staged_paths, staged_keys = _staged(facts)
            kept[0].extend(staged_paths)
            kept[1].extend(staged_keys)
            recovered.append(record)
            continue
        stray_cuda.update(_alive(_cuda_pids(facts), None))
        try:
            if isinstance(facts, RestoreFacts) and kind in (OperationKind.RESTORE, OperationKind.ACTIVATE):
                _recover_restore(deps, registry, record, facts)
            elif isinstance(facts, RestoreFacts) and kind is OperationKind.STANDBY:
                killed = _kill_restored(deps, facts.tree or JournaledTree())
                what = f"the copy being made (PIDs {killed}) was killed" if killed else "no copy was being made"
                record.finish(
                    error=_restarted(
                        f"gpusnapd restarted during {record.phase or 'the start'} of this standby; {what}; standbys "
                        "made before are kept (`gpusnap standbys`)"
                    )
                )
            elif isinstance(facts, CaptureFacts):
                _recover_capture(deps, record, facts)
            else:  # a transfer: it changed no process; a half-written local copy was removed with staging
                record.finish(
                    error=_restarted(
                        f"gpusnapd restarted during {record.phase or 'the start'} of this {kind.value}; run it again"
                    )
                )
        except Exception as exc:  # recovery goes on with the next entry
            log.exception("recovery.failed", operation_id=record.id)
            record.finish(error=_restarted(f"recovery after a gpusnapd restart failed: {type(exc).__name__}: {exc}"))
        if record.done:
            registry.adopt(record)
            log.warning(
                "recovery.finished",
                operation_id=record.id,
                state=record.state.value,
                message=str(record.error or record.facts.recovery),
            )
        recovered.append(record)
    try:
        _unlock_strays(deps, sorted(stray_cuda - suspended))
    except Exception:  # the daemon must still start; the processes are named in the log
        log.exception("recovery.cuda_unlock_failed", pids=sorted(stray_cuda - suspended))
    deps.store.buffers.release_held(keep=kept)  # handed back: the blobs no snapshot names go with the next line
    deps.store.collect_buffers()
    journal.trim()
    return recovered


def held_buffers(journal: Journal) -> tuple[list[Path], list[str]]:
    """The staged buffer files and committed blob keys (``uid/digest``) of the captures a crashed daemon left
    unfinished: the buffer store keeps them when it opens (``BufferStore.open``) for :func:`recover` to hand
    back to their quiesced workers."""
    paths: list[Path] = []
    keys: list[str] = []
    for entry in journal.entries():
        facts = journaled.of_entry(entry) if entry.running else None
        if isinstance(facts, CaptureFacts):
            entry_paths, entry_keys = _staged(facts)
            paths += entry_paths
            keys += entry_keys
    return paths, keys


def _staged(facts: CaptureFacts) -> tuple[list[Path], list[str]]:
    """One journal entry's staged buffer files and committed blob keys (:func:`held_buffers`)."""
    paths: list[Path] = []
    keys: list[str] = []
    for staged in facts.staged:
        paths += [Path(p) for p in staged.paths]
        keys += [f"{staged.uid}/{d}" for d in staged.digests]
    return paths, keys


def _cuda_pids(facts: Facts) -> list[int]:
    """Every CUDA process an unfinished operation's facts name: a capture's, or each restored tree's."""
    if isinstance(facts, CaptureFacts):
        return list(facts.cuda_pids)
    if isinstance(facts, RestoreFacts):
        trees = (*facts.earlier_trees, facts.tree) if facts.tree is not None else facts.earlier_trees
        return [p for tree in trees for p in tree.cuda_pids]
    return []


def _held_files(deps: Deps, facts: CaptureFacts, instance_id: str) -> HeldFiles | None:
    """The buffers an agent wrote out before the crash, wherever they are now: its staged file, or the blob
    it became at commit. Buffers found in neither were still held by the worker (it skips those at reload)."""
    for staged in facts.staged:
        if staged.instance_id != instance_id:
            continue
        uid, digests = staged.uid, staged.digests
        names, paths = [], []
        for n, (name, path) in enumerate(zip(staged.names, staged.paths, strict=True)):
            found = Path(path)
            if not found.is_file() and n < len(digests):
                found = deps.store.buffers.path(uid, digests[n])
            if found.is_file():
                names.append(name)
                paths.append(found)
        return HeldFiles(names, paths)
    return None


def _record(entry: Entry) -> OperationRecord | None:
    """The operation of ``entry``; ``None`` for an unfinished one whose facts do not read (a finished one's are
    not needed: it reads with none)."""
    facts = journaled.of_entry(entry)
    if facts is None and entry.running:
        return None
    record = OperationRecord(
        entry.kind,
        target_pid=entry.target_pid,
        target_snapshot=entry.target_snapshot,
        owner_uid=entry.owner_uid,
        request_id=entry.request_id,
        dry_run=entry.dry_run,
    )
    record.id = entry.id
    record.started = entry.started
    record.phase = entry.phase
    record.facts = facts or journaled.empty(entry.kind)
    if not entry.running:
        record.state = entry.state
        record.finished = datetime.fromisoformat(entry.finished) if entry.finished else datetime.now(UTC)
        err = entry.error
        if err is not None:
            record.error = error_for_code(Code(err.code), err.message, reason=err.reason)
    return record


def _restore_result(deps: Deps, record: OperationRecord, entry: Entry) -> None:
    result = entry.result
    if result is None:
        return
    if result.snapshot_id:
        try:
            record.result = deps.store.get(result.snapshot_id)
        except GpusnapError:
            record.result = None  # deleted since
    elif result.restore is not None:
        record.result = result.restore
    elif result.gpu_map is not None:
        record.result = dict(result.gpu_map)


def _restarted(message: str) -> AbortedError:
    return AbortedError(message, reason="DAEMON_RESTARTED")


def _alive(pids: Sequence[int], starts: Sequence[float] | None) -> list[int]:
    """The PIDs that still name the processes of the journal (same start time when it is known)."""
    out = []
    for n, pid in enumerate(pids):
        start = proc.start_time(pid)
        if start and (starts is None or n >= len(starts) or abs(start - starts[n]) < 0.01):
            out.append(pid)
    return out


def _recover_capture(deps: Deps, record: OperationRecord, facts: CaptureFacts) -> None:
    try:
        record.finish(result=_capture_outcome(deps, record, facts))
    except AbortedError as err:
        record.finish(error=err)


def _after_leftover_criu(deps: Deps, registry: OperationRegistry, record: OperationRecord, facts: CaptureFacts) -> None:
    """Run the rest of a checkpoint whose CRIU outlived the crashed daemon: wait for that CRIU, then remove its
    staging directory and bring the source back as :func:`_recover_capture` does. The operation holds the tree
    meanwhile, so nothing reports the source running, or captures it again, while that CRIU holds it."""
    tree = _alive(facts.tree_pids, facts.starts)
    log.warning("recovery.waiting_for_criu", operation_id=record.id, pids=leftover_criu.running(facts))

    def rest(run: PhaseRunner) -> Snapshot:
        def still(pids: list[int], seconds: float) -> None:
            log.warning("recovery.still_waiting_for_criu", operation_id=record.id, pids=pids, seconds=round(seconds))

        waited = leftover_criu.wait(facts, still)
        log.warning("recovery.criu_ended", operation_id=record.id, waited_s=round(waited, 3))
        if facts.staging:
            deps.store.remove_staging(facts.staging)
        try:
            return _capture_outcome(deps, record, facts, f"its CRIU ended {waited:.1f} s after gpusnapd restarted")
        finally:
            deps.store.buffers.release_held(only=_staged(facts))

    registry.resume(record, tree, rest)


def _capture_outcome(deps: Deps, record: OperationRecord, facts: CaptureFacts, waited: str = "") -> Snapshot:
    """Bring back the source of a capture the crashed daemon left (module docstring); its snapshot when one was
    durable before the crash.

    Raises:
        AbortedError: none was (reason ``DAEMON_RESTARTED``), saying what was undone.
    """
    tree = _alive(facts.tree_pids, facts.starts)
    done: list[str] = [waited] if waited else []
    thawed = proc.ensure_no_frozen(tree)
    if thawed:
        done.append(f"continued stopped PIDs {thawed}")
    cuda = _alive(facts.cuda_pids, None)
    if cuda and deps.gpu.available:
        deps.gpu.controller().rollback_to_running(cuda).raise_for_problems()
        done.append(f"restored and unlocked the CUDA state of PIDs {cuda}")
    for agent in facts.agents:
        if proc.alive(agent.pid):
            held = _held_files(deps, facts, agent.instance_id)
            workers.resume_source(deps, agent, held)
            back = f", with {len(held.names)} buffers read back" if held else ""
            done.append(f"resumed the worker (PID {agent.pid}){back}")
    if facts.control_dir and tree:
        controldir.signal_file(Path(facts.control_dir), record.owner_uid, controldir.RESTORE_COMPLETE)
        done.append("signalled restore-complete to the control-directory worker")
    what = "; ".join(done) or "nothing of the source needed undoing"
    snapshot_id = facts.snapshot_id
    if snapshot_id:
        try:
            snapshot = deps.store.get(snapshot_id)
        except GpusnapError:
            snapshot = None
        if snapshot is not None:  # complete and durable: the capture succeeded
            left = "was left running" if tree else "was ended, as the capture asked"
            said = f"snapshot {snapshot_id} was durable before gpusnapd restarted; the source {left} ({what})"
            record.note(CaptureFacts, lambda f: dataclasses.replace(f, recovery=said))
            return snapshot
    running = "keeps running" if tree else "is gone"
    raise _restarted(
        f"gpusnapd restarted during {record.phase or 'the start'} of this {record.kind.value}; no snapshot was "
        f"published and the process {running} ({what}); run it again"
    )


def _recover_restore(deps: Deps, registry: OperationRegistry, record: OperationRecord, facts: RestoreFacts) -> None:
    earlier, tree = facts.earlier_trees, facts.tree or JournaledTree()
    init_pid, root = tree.init_pid, tree.root
    init_alive = bool(init_pid) and bool(_alive([init_pid], [tree.init_start]))
    root_alive = bool(root) and bool(_alive([root], [tree.root_start]))
    if tree.validated and root_alive and not earlier:  # fan-outs are not adopted: all or none
        snapshot = deps.store.get(facts.snapshot_id)
        opts = RestoreOptions(snapshot=snapshot.id, env=facts.env, unset_env=facts.unset_env, values=facts.values)
        pids = list(tree.pids) or [root]
        result = RestoreResult(pid=root, pids=tuple(pids), snapshot_id=snapshot.id, namespace_pid=tree.ns_pid or root)
        record.note(RestoreFacts, lambda f: dataclasses.replace(f, recovery="adopted"))

        def resume(run: PhaseRunner) -> RestoreResult:
            run.on_failure("kill-restored", lambda: _kill(init_pid if init_alive else 0, pids))
            workers.resume_restored(run, deps, snapshot, opts, pids)
            return result

        registry.resume(record, pids, resume)
        log.warning("recovery.restore_adopted", operation_id=record.id, pid=root)
        return
    killed: list[int] = []
    for each in [*earlier, tree]:
        killed += _kill_restored(deps, each)
    outcome = "killed" if killed else "nothing restored"
    record.note(RestoreFacts, lambda f: dataclasses.replace(f, recovery=outcome))
    what = f"the half-restored tree (PIDs {killed}) was killed" if killed else "no restored process was found"
    record.finish(
        error=_restarted(
            f"gpusnapd restarted during {record.phase or 'the start'} of this restore; {what}; the snapshot is kept: "
            "restore it again"
        )
    )


def _kill_restored(deps: Deps, tree: JournaledTree) -> list[int]:
    """Release the GPU state of a journaled restored tree, then kill it; the PIDs killed."""
    init_pid, root = tree.init_pid, tree.root
    init_alive = bool(init_pid) and bool(_alive([init_pid], [tree.init_start]))
    root_alive = bool(root) and bool(_alive([root], [tree.root_start]))
    cuda = _alive(tree.cuda_pids, None)
    if cuda and deps.gpu.available:  # killing a process with GPU state hangs hosts (cuda-checkpoint#53)
        deps.gpu.controller().release_gpus_for_kill(cuda, lock_timeout_ms=int(deps.config.gpu_lock_timeout * 1000))
    strays = _started_by_helper(tree)
    if not (init_alive or root_alive or strays):
        return []
    pids = sorted(set(proc.tree_pids_or_empty(root) if root_alive else []) | set(strays))
    _kill(init_pid if init_alive else 0, pids)
    return sorted({init_pid} | set(strays)) if init_alive else pids


def _started_by_helper(tree: JournaledTree) -> list[int]:
    """What the journaled CRIU helper of a restore may have left: itself and its process group (CRIU), and,
    for a restore into gpusnapd's PID namespace, each PID the snapshot's tree had that a process started
    since the helper holds (CRIU gives restored tasks their old PIDs). Empty when no helper was journaled."""
    helper, since = tree.helper_pid, tree.helper_start
    if not helper or not since:
        return []
    found = set(_alive([helper], [since])) | set(proc.group_members(helper, since - START_SLACK_S))
    for pid in tree.expect_pids:
        start = proc.start_time(pid)
        if start and start >= since - START_SLACK_S and proc.alive(pid):
            found.add(pid)
    return sorted(found)


START_SLACK_S = leftover_criu.START_SLACK_S


def _kill(init_pid: int, pids: list[int]) -> None:
    if init_pid:
        restored.end_now(init_pid)  # (the init removes the tree's file copies)
    proc.kill_tree(pids)


def _unlock_strays(deps: Deps, pids: list[int]) -> None:
    """Restore and unlock CUDA processes left LOCKED or CHECKPOINTED by a crashed operation."""
    if not pids or not deps.gpu.available or deps.gpu.cuda is None:
        return
    stuck = []
    for pid in pids:
        try:
            if deps.gpu.cuda.get_state(pid) in (ProcessState.LOCKED, ProcessState.CHECKPOINTED):
                stuck.append(pid)
        except GpusnapError:
            continue
    if stuck:
        log.warning("recovery.cuda_unlocked", pids=stuck)
        deps.gpu.controller().rollback_to_running(stuck)
