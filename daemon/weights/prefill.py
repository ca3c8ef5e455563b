"""Device memory filled by gpusnapd during a restore (``gpu_prefill = "auto"``, ``gpusnapd --gpu-prefill``).

Without it a restored worker gets its buffers back after CRIU and the CUDA restore: the agent reads each
blob and copies it to the device (``reload-buffers``, 0.90 s for 16 GB on an H200). With it, for every
address-stable arena of the snapshot (``WorkerInfo.arenas``, reported by the agent at capture) gpusnapd
creates the arena's physical memory on the target GPU and fills it from the blobs
(:class:`gpusnap.daemon.weights.devicefill.DeviceFiller`) on a thread of its own, *while* CRIU and the CUDA
driver restore the worker; at ``reload-buffers`` it hands the exported descriptors to the restored tree's
agent (``MapArenas``), which maps them at the arena's addresses (CUDA graphs stay valid), and releases its
own handles. Buffers outside an arena, and arenas it could not fill, are read back as before; the
phase's progress says per process how many bytes were prefilled and how many read back, and why prefill
was not used where it was not.

Falls back to the reload, never fails a restore: probe off or failed at start, a snapshot without arena
layouts (taken before gpusnap recorded them), a layout that does not check out (it comes from the worker,
so it is checked like any input: sizes, chunking, bounds, one buffer per placed storage, a GPU its process
used at capture), a GPU gpusnapd cannot fill, too little free device memory (the arena plus what the
worker's CUDA restore needs), any driver error, or the worker refusing the handles. Every descriptor and
handle gpusnapd created is released on every path (:meth:`Prefill.close`, registered as a rollback step
and run when the restore copy ends).

What is verified, and when (as strongly as the reload path: ``gpusnap.daemon.store.buffers``): the blobs'
sizes at preflight (``check_present``) and again on the opened descriptor before any byte is mapped
(``DeviceFiller.fill``); with ``--verify-buffers`` their digests, computed in the background from the
restore's start and checked (``buffers_verified``) before the filled memory reaches the worker, as before
a reload hands the worker its blob descriptors. Exported descriptors go only to the agent session found
among the restored tree's processes for that worker's instance id.

So that a snapshot's first restore is as fast as its next ones, gpusnapd prepares in the background
(:meth:`PrefillSupport.warm`, at start): it creates its context on every GPU it can fill, then registers
ahead (``DeviceFiller.register_ahead``) the RAM-tier blobs of the arenas of the snapshots already in the
store, most recently used first, and those of each snapshot a checkpoint publishes afterwards
(:meth:`PrefillSupport.after_publish`), within the filler's budget for kept registrations. Nothing there
delays the daemon's start or an operation, and nothing there can fail one: a failure is logged, and the
restore then does that work itself or falls back as above.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import structlog

from gpusnap.adapters.contract import wire
from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.api.types import ArenaLayout, BufferRef, FinishedOperation, GpuPrefill, Snapshot, WorkerInfo
from gpusnap.daemon.drivers.cuda import normalize_gpu_uuid
from gpusnap.daemon.gpu import gpumap
from gpusnap.daemon.store.buffers import BufferStore
from gpusnap.daemon.weights.devicefill import DeviceFiller, FilledArena, PrefillError, Source
from gpusnap.daemon.weights.exchange import fd_batches

if TYPE_CHECKING:
    from pathlib import Path

    from gpusnap.daemon.workers.client import AgentClient

log = structlog.get_logger(__name__)

MAX_CHUNKS = wire.MAX_FDS
"""Chunks one arena may claim (one descriptor each, in one frame; 1 GiB chunks: 200 GiB)."""
CLOSE_WAIT_S = 60.0
"""How long a restore's end waits for its fill thread to see the cancel (each copy checks it) before
leaving it, logged, rather than hanging the restore on a driver call that never returns."""


class PrefillSupport:
    """The node's prefill setting and what its start-time probe found.

    Args:
        mode: ``off`` or ``auto``.
        filler: the driver layer, ``None`` when off or the probe failed.
        gpus: GPU UUID → ``""`` (usable) or why not, from :meth:`DeviceFiller.probe`.
        reason: why prefill is off (empty when on).
        jobs: where the registrations ahead run, in the order queued: gpusnapd's ``prefill`` lane (one thread,
            ``gpusnap.daemon.executor``); its owner shuts it down; after :meth:`close` nothing more is queued
            and what was queued is skipped.
    """

    def __init__(
        self,
        mode: str,
        filler: DeviceFiller | None = None,
        gpus: Mapping[str, str] | None = None,
        reason: str = "",
        *,
        jobs: Executor,
    ):
        self.mode = mode
        self.filler = filler
        self.gpus = dict(gpus or {})
        self.reason = reason if filler is None else ""
        self.contexts = ""
        """gpusnapd's contexts: ``""`` (not asked for), ``creating``, ``ready`` or ``failed (why)``."""
        self._store: BufferStore | None = None
        self._jobs = jobs
        self._warm = False
        self._queued = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @classmethod
    def probe(cls, mode: str, driver: Any = None, *, jobs: Executor) -> PrefillSupport:
        """Probe the driver (``driver``: ``cuda.bindings.driver`` when ``None``, or a fake with its calls) when
        ``mode`` is ``auto`` (cuda.bindings importable, ``cuInit``, VMM and POSIX descriptor handles per GPU);
        never raises: a failed probe leaves prefill off with its reason. ``jobs``: see the class."""
        if mode != "auto":
            return cls(mode, reason="off (gpu_prefill = off)", jobs=jobs)
        filler = DeviceFiller(driver)
        try:
            gpus = filler.probe()
        except Exception as exc:  # noqa: BLE001 (never fails the daemon's start: prefill stays off)
            log.warning("gpu.prefill_unavailable", reason=str(exc))
            return cls(mode, reason=f"probe failed: {exc}", jobs=jobs)
        if not any(v == "" for v in gpus.values()):
            why = "; ".join(f"{u}: {v}" for u, v in gpus.items()) or "no GPU"
            log.warning("gpu.prefill_unavailable", reason=why)
            return cls(mode, reason=f"no GPU supports it ({why})", jobs=jobs)
        log.info("gpu.prefill", gpus={u: v or "ok" for u, v in gpus.items()})
        return cls(mode, filler, gpus, jobs=jobs)

    @property
    def enabled(self) -> bool:
        """True when the probe found at least one GPU to fill."""
        return self.filler is not None

    @property
    def state(self) -> str:
        """For logs and people: :meth:`GpuPrefill.summary` of :meth:`status`."""
        return self.status().summary()

    def status(self) -> GpuPrefill:
        """For ``gpusnap node``: on or off (why), and how far contexts and registrations are."""
        if self.filler is None:
            return GpuPrefill(enabled=False, reason=self.reason or None)
        return GpuPrefill(
            enabled=True,
            gpus=len(self.gpus),
            usable_gpus=sum(1 for v in self.gpus.values() if not v),
            contexts=self.contexts or None,
            registered_bytes=self.filler.registered_bytes(),
            registering=bool(self._queued),
        )

    def warm(self, store: BufferStore, snapshots: Callable[[], Iterable[Snapshot]]) -> None:
        """Start, in the background, creating gpusnapd's context on every GPU it can fill, then registering
        ahead the RAM-tier arena blobs of ``snapshots()`` (the store's, at start), most recently used first;
        later :meth:`after_publish` calls queue behind it. Returns at once; nothing when prefill is off."""
        if self.filler is None:
            return
        self._store = store
        self._warm = True
        self.contexts = "creating"
        self._submit(self._create_contexts)
        self._submit(lambda: self._register_ahead(snapshots()))

    def after_operation(self, finished: FinishedOperation) -> None:
        """A checkpoint (or pull) that published a snapshot: :meth:`after_publish` it (it subscribes to the
        operation registry)."""
        if finished.succeeded and isinstance(finished.result, Snapshot):
            self.after_publish(finished.result)

    def after_publish(self, snapshot: Snapshot) -> None:
        """Queue the registration ahead of ``snapshot``'s RAM-tier arena blobs (a checkpoint just published
        it; a pulled one is registered by its first restore's fill, or at gpusnapd's next start); returns
        at once."""
        if self.filler is not None and self._warm:
            self._submit(lambda: self._register_ahead([snapshot]))

    def close(self) -> None:
        """Stop the background work (gpusnapd's stop): nothing more is queued, what is queued is skipped, a
        registration in progress finishes (the lane itself is its owner's to shut down)."""
        self._stop.set()

    def _submit(self, job: Callable[[], object]) -> None:
        def run() -> None:
            try:
                if not self._stop.is_set():
                    job()
            except Exception:  # never fails anything: a restore does the work itself, or falls back
                log.exception("prefill.warm_failed")
            finally:
                with self._lock:
                    self._queued -= 1

        if self._stop.is_set():  # closed: nothing more is queued
            return
        with self._lock:
            self._queued += 1
        try:
            self._jobs.submit(run)
        except RuntimeError:  # (closed)
            with self._lock:
                self._queued -= 1

    def _create_contexts(self) -> None:
        assert self.filler is not None
        failed = []
        for uuid, why in self.gpus.items():
            if not why:
                try:
                    self.filler.warm(uuid)
                except PrefillError as exc:
                    failed.append(f"{uuid}: {exc}")
        self.contexts = f"failed ({'; '.join(failed)})" if failed else "ready"
        if failed:
            log.warning("prefill.context_failed", reason=self.contexts)
        else:
            log.info("prefill.contexts_ready", gpus=sum(1 for v in self.gpus.values() if not v))

    def _register_ahead(self, snapshots: Iterable[Snapshot]) -> None:
        """Register the RAM-tier blobs of the arenas :func:`plan` would fill for ``snapshots`` (on their own
        GPUs), most recently used first (the tier's LRU mark), as far as the filler's budget allows."""
        store, filler = self._store, self.filler
        assert store is not None and filler is not None
        found: dict[Path, tuple[int, str]] = {}
        for snapshot in snapshots:
            for p in plan(snapshot, None)[0]:
                if self.gpus.get(p.target, "a GPU gpusnapd does not see"):
                    continue
                for r in p.refs:
                    path = store.path(snapshot.buffer_uid, r.sha256)
                    if store.in_ram_tier(path):
                        found.setdefault(path, (r.size_bytes, p.target))

        def last_used(path: Path) -> float:
            try:
                return os.stat(path).st_mtime
            except OSError:
                return 0.0

        for path in sorted(found, key=last_used, reverse=True):
            if self._stop.is_set():
                return
            nbytes, gpu = found[path]
            try:  # (no mark_used: registering is not a use)
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue  # removed meanwhile
            try:
                filler.register_ahead(fd, nbytes, gpu)
            except (PrefillError, OSError) as exc:
                log.warning("prefill.register_ahead_failed", bytes=nbytes, error=str(exc))
            finally:
                os.close(fd)


@dataclasses.dataclass(frozen=True)
class Planned:
    """One arena to fill: its worker's agent, its 1-based index there, its layout, the target GPU, its
    buffers (by offset) and the device memory the worker's CUDA restore needs on that GPU."""

    agent: str
    index: int
    layout: ArenaLayout
    target: str
    refs: tuple[BufferRef, ...]
    reserve_bytes: int


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def check_layout(layout: ArenaLayout, refs: Sequence[BufferRef]) -> str:
    """Why the worker's description of one arena and the buffers in it cannot be filled; ``""`` when it can.

    The layout comes from the worker: it must chunk its size in multiples of a power-of-two granularity,
    hold exactly its placed storages as non-overlapping buffers, and be no larger than they need."""
    g, chunks = layout.granularity, layout.chunk_bytes
    if g < 4096 or g & (g - 1) or not 0 < len(chunks) <= MAX_CHUNKS:
        return f"granularity {g} or {len(chunks)} chunks"
    if any(c <= 0 or c % g for c in chunks) or sum(chunks) != layout.size_bytes:
        return "chunks that are not multiples of the granularity or do not add up to its size"
    if layout.storages != len(refs) or not refs:
        return (
            f"{layout.storages} storages placed but {len(refs)} of them buffers of the snapshot (others are not stable)"
        )
    end = 0
    for r in sorted(refs, key=lambda r: r.arena_offset):
        if r.arena_offset < end:
            return f"buffer {r.name!r} overlapping another"
        end = r.arena_offset + r.size_bytes
    if end > layout.size_bytes or layout.size_bytes > _round_up(end, g):
        return f"a size of {layout.size_bytes} bytes for {end} bytes of buffers"
    return ""


def plan(snapshot: Snapshot, gpu_map: Mapping[str, str] | None) -> tuple[list[Planned], dict[str, list[str]]]:
    """The arenas of ``snapshot`` to fill, and per agent (instance id) why its other buffers are not.

    An arena's GPU is the worker's word: it is filled only where the worker's process held device memory at
    capture, on the GPU ``gpu_map`` sends that one to, so a worker cannot have
    gpusnapd allocate on a GPU outside its tree's (another tenant's)."""
    plans: list[Planned] = []
    skipped: dict[str, list[str]] = {}
    need = gpumap.memory_needed(snapshot.gpu_processes) if snapshot.gpu_processes else {}
    moved = {normalize_gpu_uuid(k): normalize_gpu_uuid(v) for k, v in (gpu_map or {}).items()}
    used: dict[int, set[str]] = {}
    for g in snapshot.gpu_processes:
        used.setdefault(g.pid, set()).update(normalize_gpu_uuid(u) for u in g.gpu_uuids)
    for worker in snapshot.all_workers:
        refs = snapshot.buffers_of(worker)
        in_arenas = [r for r in refs if r.arena]
        why_not = skipped.setdefault(worker.instance_id, [])
        if len(in_arenas) < len(refs):
            why_not.append(
                f"{len(refs) - len(in_arenas)} buffers lie in no address-stable arena, or the snapshot records none "
                "(taken before gpusnap recorded arena layouts)"
            )
        if in_arenas and not worker.arenas:
            why_not.append("the snapshot records no arena layout")
            continue
        for index, layout in enumerate(worker.arenas, start=1):
            mine = tuple(r for r in in_arenas if r.arena == index)
            why = check_layout(layout, mine)
            try:
                source = normalize_gpu_uuid(layout.gpu_uuid)
            except GpusnapError:
                why = why or f"GPU {layout.gpu_uuid!r}"
                source = ""
            if not why and source not in used.get(worker.pid, ()):
                why = f"GPU {layout.gpu_uuid}, " + (
                    "a GPU its process did not use at capture"
                    if snapshot.gpu_processes
                    else "but the snapshot records no GPU use"
                )
            if why:
                why_not.append(f"arena {index}: the worker reported {why}")
                continue
            reserve = sum(v for k, v in need.items() if normalize_gpu_uuid(k) == source)
            plans.append(Planned(worker.instance_id, index, layout, moved.get(source, source), mine, reserve))
        stray = [r.name for r in in_arenas if not 0 < r.arena <= len(worker.arenas)]
        if stray:
            why_not.append(f"buffers {stray[:3]} name no recorded arena")
    return plans, {k: v for k, v in skipped.items() if v}


class Prefill:
    """One restore copy's fills, run on a thread of their own from :meth:`start` on.

    Args:
        support: the node's :class:`PrefillSupport` (enabled).
        store: the buffer store the blobs are read from.
        uid: the snapshot's buffer uid (its blobs are ``sha256/<uid>/<digest>``).
        plans: the arenas to fill, in order (:func:`plan`).
        skipped: agent instance id → why some of its buffers are not planned (:func:`plan`), for the
            progress messages.
    """

    def __init__(
        self,
        support: PrefillSupport,
        store: BufferStore,
        uid: int,
        plans: Sequence[Planned],
        skipped: Mapping[str, Sequence[str]],
    ):
        assert support.filler is not None
        self.filler = support.filler
        self.support = support
        self.store = store
        self.uid = uid
        self.plans = list(plans)
        self.problems: dict[str, list[str]] = {k: list(v) for k, v in skipped.items()}
        """Agent instance id → why some of its buffers were not prefilled."""
        self.general: list[str] = []
        self._filled: dict[str, list[tuple[Planned, FilledArena]]] = {}
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpusnap-prefill", daemon=True)
        self.fill_s = 0.0

    def start(self) -> Prefill:
        """Start the fills on their thread; returns ``self``."""
        self._thread.start()
        return self

    def _run(self) -> None:
        start = time.monotonic()
        for p in self.plans:
            if self._cancel.is_set():
                break
            why = self.support.gpus.get(p.target, "a GPU gpusnapd does not see")
            if why:
                self._problem(p, f"GPU {p.target}: {why}")
                continue
            fds: list[int] = []
            try:
                # The layout's granularity is the worker's word: a made-up one (16 times the GPU's) let one
                # small buffer's arena pass check_layout at up to all free device memory. The GPU's own decides.
                granularity = self.filler.granularity(p.target)
                why = check_layout(dataclasses.replace(p.layout, granularity=granularity), p.refs)
                if why:
                    self._problem(
                        p, f"GPU {p.target} allocates in {granularity}-byte granules: the worker reported {why}"
                    )
                    continue
                fds = self.store.open_for_read(self.uid, list(p.refs))
                sources = [
                    Source(
                        fd,
                        r.size_bytes,
                        r.arena_offset,
                        keep=self.store.in_ram_tier(self.store.path(self.uid, r.sha256)),
                    )
                    for fd, r in zip(fds, p.refs, strict=True)
                ]
                filled = self.filler.fill(
                    p.target,
                    p.layout.chunk_bytes,
                    sources,
                    reserve_bytes=p.reserve_bytes,
                    cancelled=self._cancel.is_set,
                )
            except (PrefillError, OSError) as exc:
                self._problem(p, str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 (a fill never fails the restore: it falls back)
                log.exception("prefill.failed")
                self._problem(p, f"{type(exc).__name__}: {exc}")
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            with self._lock:
                if self._cancel.is_set():
                    release([filled])
                    break
                self._filled.setdefault(p.agent, []).append((p, filled))
            log.info(
                "prefill.filled", arena=p.index, gpu=p.target, bytes=filled.nbytes, seconds=round(filled.seconds, 3)
            )
        self.fill_s = time.monotonic() - start

    def _problem(self, p: Planned, why: str) -> None:
        log.warning("prefill.fallback", arena=p.index, gpu=p.target, reason=why)
        with self._lock:
            self.problems.setdefault(p.agent, []).append(f"arena {p.index}: {why}")

    def take(self, agent: str, timeout_s: float) -> list[tuple[Planned, FilledArena]]:
        """Wait for the fills (at most ``timeout_s``) and take ``agent``'s filled arenas; the caller releases
        them (:meth:`FilledArena.release`) once handed over. A fill still running after the timeout is
        cancelled and its arenas are read back instead."""
        self._thread.join(timeout_s)
        with self._lock:
            if self._thread.is_alive():
                self._cancel.set()
                late = f"the fill took longer than {timeout_s:.0f} s"
                if late not in self.general:  # (every worker's reload takes its arenas, in parallel)
                    self.general.append(late)
            return self._filled.pop(agent, [])

    def why_not(self, agent: str) -> str:
        """Why some or all of ``agent``'s arenas were not prefilled (one line; empty when they all were)."""
        with self._lock:
            return "; ".join(self.general + self.problems.get(agent, []))

    def close(self) -> None:
        """Stop the fills and release every arena not handed over (idempotent; the rollback step)."""
        self._cancel.set()
        if self._thread.ident is not None:
            self._thread.join(CLOSE_WAIT_S)
            if self._thread.is_alive():  # a driver call that never returns: its arena is left to the thread
                log.error("prefill.fill_hung", waited_s=CLOSE_WAIT_S)
        with self._lock:
            left = [f for arenas in self._filled.values() for _, f in arenas]
            self._filled.clear()
        release(left)


def start(
    support: PrefillSupport | None, store: BufferStore, snapshot: Snapshot, gpu_map: Mapping[str, str] | None
) -> Prefill | None:
    """Start filling ``snapshot``'s arenas on the GPUs ``gpu_map`` sends them to (``None`` for a snapshot
    without GPU state: the GPUs they were on); ``None`` when prefill is off or the snapshot has no buffers."""
    if support is None or not support.enabled or not snapshot.buffers:
        return None
    plans, skipped = plan(snapshot, gpu_map)
    return Prefill(support, store, snapshot.buffer_uid, plans, skipped).start()


def hand_over(prefill: Prefill, worker: WorkerInfo, client: AgentClient, timeout_s: float) -> set[str]:
    """Give ``worker``'s filled arenas to its restored agent (``client``: the session found among the
    restored tree's processes) and release gpusnapd's handles; returns the names of the buffers the worker
    now holds. Never raises for a refusal: the worker's arenas are then read back (the reason is in
    :meth:`Prefill.why_not`)."""
    filled = prefill.take(worker.instance_id, timeout_s)
    done: set[str] = set()
    try:
        for batch in fd_batches(filled, lambda item: len(item[1].fds)):  # (one MapArenas frame each)
            fds = [fd for _, f in batch for fd in f.fds]
            client.map_arenas([(p.index, [r.name for r in p.refs]) for p, _ in batch], fds, timeout_s)
            done.update(r.name for p, _ in batch for r in p.refs)
    except GpusnapError as exc:
        log.warning("prefill.refused", pid=worker.pid, error=str(exc))
        with prefill._lock:
            prefill.problems.setdefault(worker.instance_id, []).append(f"the worker did not map them ({exc})")
    finally:
        release(f for _, f in filled)
    return done


def release(arenas: Iterable[FilledArena]) -> None:
    """Release gpusnapd's handles and descriptors of every arena in ``arenas``. A release the driver refuses
    is logged, never raised: it must neither keep the other arenas with gpusnapd nor fail a restore whose
    worker already holds the memory (what stays is gpusnapd's handle, freed with its context at exit)."""
    for f in arenas:
        try:
            f.release()
        except PrefillError as exc:
            log.warning("prefill.release_failed", error=str(exc))
