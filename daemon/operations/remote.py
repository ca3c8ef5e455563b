"""Push and pull: snapshots between this node's store and the remote store.

Push phases: ``preflight`` (snapshot readable, caller allowed, buffers present) → [``fetch-buffers``:
blobs the disk tier evicted, back from the remote, ``gpusnap.daemon.remote.evict``] → ``upload`` (every chunk
the remote lacks; the chunks read must make up the recorded digests) → ``publish`` (the manifest, last,
by a conditional put). Nothing is listed remotely before ``publish``; an interrupted push leaves chunks
that the next push reuses and garbage collection removes after its grace period.

Pull phases: ``preflight`` (manifest read and checked, caller allowed, compatibility gate, room; while another
operation downloads the same snapshot, it waits for that download and takes its result: :func:`_own_pull`) →
``download`` (into ``<store>/pulls/<id>`` and the buffer store's ``pulling/<id>``, every chunk checked
against its digest; chunks an interrupted pull already wrote are kept after the same check, unless it
lay untouched for ``pull_grace``: ``SnapshotStore.expire_pulls``; a download that ran out of room removes
what it wrote, which ``gpusnap store`` shows root meanwhile as unfinished pulls) →
``publish`` (buffers adopted into the buffer store, then one rename into ``snapshots/``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from gpusnap.daemon.access import callers
from gpusnap.daemon.api.errors import AbortedError, FailedPreconditionError, ResourceExhaustedError
from gpusnap.daemon.api.types import Caller, TransferResult
from gpusnap.daemon.operations import provenance
from gpusnap.daemon.operations.base import Phase, PhaseRunner
from gpusnap.daemon.operations.deps import Deps
from gpusnap.daemon.remote import evict
from gpusnap.daemon.remote.layout import RemoteManifest
from gpusnap.daemon.remote.store import RemoteStore
from gpusnap.daemon.remote.transfer import Item, Tally, pull_chunks, push_chunks
from gpusnap.daemon.store.store import IMAGES, SnapshotStore


def require_remote(deps: Deps) -> RemoteStore:
    """The configured remote store.

    Raises:
        FailedPreconditionError: none configured (``REMOTE_NOT_CONFIGURED``).
    """
    if deps.remote is None:
        raise FailedPreconditionError(
            "gpusnapd has no remote store: start it with --remote s3://BUCKET/PREFIX (and --remote-endpoint URL "
            "for a non-AWS service), or set remote in its config file",
            reason="REMOTE_NOT_CONFIGURED",
        )
    return deps.remote


def _result(snapshot_id: str, remote: RemoteStore, tally: Tally) -> TransferResult:
    return TransferResult(
        snapshot_id=snapshot_id,
        remote=str(remote),
        transferred_bytes=tally.transferred_bytes,
        skipped_bytes=tally.skipped_bytes,
        transferred_chunks=tally.transferred_chunks,
        skipped_chunks=tally.skipped_chunks,
        buffer_transferred_bytes=tally.buffer_transferred_bytes,
    )


def run_push(run: PhaseRunner, deps: Deps, ref: str, caller: Caller) -> TransferResult:
    """The body of a push operation (see the module docstring)."""
    remote = require_remote(deps)
    store = deps.store
    with contextlib.ExitStack() as stack:
        with run.phase(Phase.PREFLIGHT):
            snap = store.get(ref, caller.uid)
            callers.check_may_restore(snap, caller, lambda: store.not_found(ref))
            uid = snap.buffer_uid
            blobs = {b.sha256: b for b in snap.buffers}  # a blob shared by two names goes once
            missing = store.buffers.missing(uid, snap.buffers)
            if missing and remote.published(snap.id):
                return TransferResult(snapshot_id=snap.id, remote=str(remote))  # evicted to it: there already
            store.buffers.pin(uid, blobs)  # before the check: the disk tier must not drop them meanwhile
            stack.callback(store.buffers.unpin, uid, blobs)
            refetch = evict.plan(store, remote, snap) if missing else None
            if refetch is None:
                store.buffers.check_present(snap.id, uid, snap.buffers)
            prov = provenance.of_snapshot(deps, snap)
        if refetch is not None:  # a blob it shares with a snapshot evicted to the remote: back first
            with run.phase(Phase.FETCH_BUFFERS) as p:
                p.bytes = evict.fetch(store, remote, refetch, p.every_percent()).transferred_bytes
            store.buffers.check_present(snap.id, uid, snap.buffers)
        images = store.images_dir(snap.id)
        items = [Item(f.path, images / f.path, f.size_bytes) for f in snap.files]
        digests = [f.sha256 for f in snap.files] + list(blobs)
        items += [
            Item(f"buffer {b.name}", store.buffers.path(uid, d), b.size_bytes, is_buffer=True) for d, b in blobs.items()
        ]
        with run.phase(Phase.UPLOAD) as p:
            chunk_lists, tally = push_chunks(remote.objects, remote.limits, items, digests, p.every_percent())
            p.bytes = tally.transferred_bytes
    n = len(snap.files)
    doc = RemoteManifest(snap, prov, tuple(chunk_lists[:n]), dict(zip(blobs, chunk_lists[n:], strict=True)))
    run.commit("the upload is complete and its manifest goes up, which lists the snapshot in the remote store")
    with run.phase(Phase.PUBLISH):
        if not remote.publish(doc):
            run.log.info("push.already_published", snapshot_id=snap.id)
        evict.write_record(store.snapshots_dir / snap.id, str(remote), doc.buffer_chunks)
    if blobs:
        store.buffers.schedule_budgets()  # the disk tier may now drop them (remote.evict)
    return _result(snap.id, remote, tally)


def run_pull(run: PhaseRunner, deps: Deps, ref: str, caller: Caller) -> TransferResult:
    """The body of a pull operation (see the module docstring)."""
    remote = require_remote(deps)
    store = deps.store
    with contextlib.ExitStack() as stack:
        with run.phase(Phase.PREFLIGHT):
            doc = remote.find(ref, caller.uid)
            snap = doc.snapshot
            run.record.target_snapshot = snap.id
            callers.check_may_restore(snap, caller, lambda: remote.not_found(ref))
            if not _own_pull(run, store, snap.id, stack):  # another operation's download brought it here
                return TransferResult(snapshot_id=snap.id, remote=str(remote))
            provenance.check(deps, snap.id, doc.provenance)
            if snap.name:
                store.check_name_free(snap.name, snap.owner_uid)
            store.expire_pulls()  # what other pulls left, past the grace period
            work = store.pulls_dir / snap.id
            blob_work = store.buffers.pulling / snap.id
            uid = snap.buffer_uid
            items = [Item(f.path, work / IMAGES / f.path, f.size_bytes) for f in snap.files]
            chunk_lists: list[tuple[str, ...]] = list(doc.file_chunks)
            blobs = store.buffers.missing(uid, snap.buffers)
            items += [Item(f"buffer {b.name}", blob_work / d, b.size_bytes, is_buffer=True) for d, b in blobs.items()]
            chunk_lists += [doc.buffer_chunks[d] for d in blobs]
            _check_room(store.pulls_dir, sum(f.size_bytes for f in snap.files), "snapshot store", "--store")
            _check_room(store.buffers.root, sum(b.size_bytes for b in blobs.values()), "buffer store", "--buffer-dir")
        with run.phase(Phase.DOWNLOAD) as p, _room_given_back(work, blob_work):
            tally = pull_chunks(remote.objects, remote.limits, items, chunk_lists, p.every_percent())
            p.bytes = tally.transferred_bytes
        run.commit("the download is complete and the snapshot is being added to the store")
        with run.phase(Phase.PUBLISH), _room_given_back(work, blob_work):
            digests = [b.sha256 for b in snap.buffers]
            store.buffers.pin(uid, digests)
            try:
                store.buffers.adopt_pulled(blob_work, uid, blobs)
                store.buffers.check_present(snap.id, uid, snap.buffers)
                evict.write_record(work, str(remote), doc.buffer_chunks)
                store.publish_pulled(work, snap, provenance.to_bytes(doc.provenance))
            finally:
                store.buffers.unpin(uid, digests)
            shutil.rmtree(blob_work, ignore_errors=True)
            if blobs:
                store.buffers.schedule_budgets()
    return _result(snap.id, remote, tally)


WAIT_POLL_S = 0.5
"""How often a pull waiting for another operation's download of the same snapshot checks for a cancel."""


def _own_pull(run: PhaseRunner, store: SnapshotStore, snapshot_id: str, stack: contextlib.ExitStack) -> bool:
    """Take the pull of ``snapshot_id`` (held on ``stack``), or find it in the store: True when this operation
    downloads it, False when it is here already. While another operation downloads it, this one waits for that
    download (its work slot free meanwhile) and takes what it published, as concurrent pulls of one container
    image do: two restores of one remote-only snapshot fetch it once (issue 26, item 8). If that download
    fails, this one pulls, resuming from what it left.

    Raises:
        CancelledError: cancelled while it waited.
    """
    while True:
        if (store.snapshots_dir / snapshot_id).exists():
            return False
        try:
            stack.enter_context(store.pulling(snapshot_id))
            return True
        except AbortedError as busy:
            if busy.reason != "SNAPSHOT_BUSY":
                raise
        run.log.info("pull.waiting_for_another", snapshot_id=snapshot_id)
        with run.waiting():
            while not store.wait_pulled(snapshot_id, WAIT_POLL_S):
                run.check_cancelled(during=True)


@contextlib.contextmanager
def _room_given_back(*work: Path) -> Iterator[None]:
    """A pull that runs out of room removes what it wrote (a retry needs that room first; ``expire_pulls``
    would keep it for ``pull_grace``)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            for path in work:
                shutil.rmtree(path, ignore_errors=True)
        raise


def _check_room(directory: os.PathLike[str] | str, need: int, what: str, flag: str) -> None:
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise ResourceExhaustedError(
            f"the pull needs {need / 2**30:.2f} GiB in the {what} but {free / 2**30:.2f} GiB are free; delete "
            f"snapshots (`gpusnap rm`) or give gpusnapd a larger {flag}",
            reason="STORE_FULL",
        )
