"""Preflight checks for GPU capture and restore: pure functions over facts gathered beforehand.

Every ``check_*`` function takes plain values (strings, mappings, :class:`GpuDevice` lists) and raises a
:class:`~gpusnap.daemon.api.errors.GpusnapError` naming the fact and the remedy; none calls NVML, CUDA or reads
files, so the same facts can be logged, stored in a manifest and unit-tested. All checks run **before any PID
is locked** (a failed capture must not harm a healthy source, snap#308). :func:`check_capture` and
:func:`check_restore` run them all and report every failure at once.

Error classes: environment facts (driver, arch, MIG, MPS, device files, NCCL env) raise
``FailedPreconditionError``; shortages of GPU memory or host RAM raise ``ResourceExhaustedError`` (the error tree
reserves it for "not enough disk, host RAM or GPU memory"); the combined checks raise ``FailedPreconditionError``
(reason ``PREFLIGHT_FAILED``) when more than one check fails.

The facts come from ``gpusnap.daemon.drivers.procfs`` (``/proc`` under a ``proc_root``, so tests can point the
readers at a fake tree), NVML and ``drivers.host``; :func:`check_tree` gathers them for a capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from gpusnap.adapters.contract import capture_settings, registry
from gpusnap.daemon.api.errors import FailedPreconditionError, GpusnapError, ResourceExhaustedError
from gpusnap.daemon.drivers import host, procfs
from gpusnap.daemon.drivers.cuda import normalize_gpu_uuid
from gpusnap.daemon.drivers.nvml import GpuDevice
from gpusnap.daemon.drivers.procfs import DEFAULT_MPS_PIPE_DIR
from gpusnap.daemon.gpu.support import GpuSupport, GpuTree

#: Minimum NVIDIA driver major for CUDA checkpoint via the driver API with CRIU (docs/cuda-checkpoint.md, FC-16).
MIN_DRIVER_MAJOR = 570
#: Minimum driver major for restoring onto other GPUs (``gpuPairs``; docs/cuda-checkpoint.md).
MIN_DRIVER_MAJOR_REMAP = 580
#: Machines CUDA checkpoint supports (cuda-checkpoint README: x86-64 only; FC-15).
SUPPORTED_MACHINES = frozenset({"x86_64", "amd64"})
#: Device files CRIU cannot dump, with the fix for each (FC-20; vLLM snapshot refuses /dev/infiniband).
FORBIDDEN_DEVICES: Mapping[str, str] = {
    "/dev/gdrdrv": (
        "gdrcopy is in use: disable it in the workload (e.g. NCCL_GDRCOPY_ENABLE=0, UCX_TLS without gdr_copy, the "
        "engine's gdrcopy option); CRIU's --external dev[...] is not enough (FC-20)"
    ),
    "/dev/infiniband/": "RDMA devices are open: set NCCL_IB_DISABLE=1 (and UCX_TLS=tcp,self) in the worker",
}
#: Host RAM kept free on top of what checkpoint stages, in bytes.
DEFAULT_HOST_HEADROOM_BYTES = 1 << 30

_GIB = float(1 << 30)


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"


def driver_major(driver_version: str) -> int:
    """Major number of an NVIDIA driver version string.

    Args:
        driver_version: e.g. ``"580.159.04"``.

    Returns:
        e.g. ``580``.

    Raises:
        FailedPreconditionError: unparsable (reason ``NVIDIA_DRIVER_UNKNOWN``).
    """
    head = driver_version.strip().split(".", 1)[0]
    if not head.isdigit():
        raise FailedPreconditionError(
            f"cannot read the NVIDIA driver version {driver_version!r}; is the NVIDIA driver installed (nvidia-smi)?",
            reason="NVIDIA_DRIVER_UNKNOWN",
            metadata={"driver_version": driver_version},
        )
    return int(head)


def check_driver_version(driver_version: str, *, remapping: bool = False) -> None:
    """Driver major ≥ 570, or ≥ 580 when restoring onto other GPUs.

    Args:
        driver_version: NVIDIA driver version, e.g. ``"580.159.04"`` (NVML).
        remapping: the restore uses non-identity ``gpuPairs``.

    Raises:
        FailedPreconditionError: reason ``NVIDIA_DRIVER_TOO_OLD``.
    """
    major = driver_major(driver_version)
    need = MIN_DRIVER_MAJOR_REMAP if remapping else MIN_DRIVER_MAJOR
    if major < need:
        why = (
            "restoring onto other GPUs (gpuPairs) needs driver >= 580"
            if remapping
            else "CUDA checkpoint with CRIU needs driver >= 570 (older drivers leave /dev/nvidia* open, FC-16)"
        )
        raise FailedPreconditionError(
            f"NVIDIA driver {driver_version} is too old: {why}; upgrade the driver"
            + ("" if not remapping else " or restore onto the original GPUs"),
            reason="NVIDIA_DRIVER_TOO_OLD",
            metadata={"driver_version": driver_version, "required_major": str(need)},
        )


def check_machine(machine: str) -> None:
    """Only x86-64 hosts (``uname -m``) can checkpoint (FC-15: aarch64 returns NOT_SUPPORTED).

    Raises:
        FailedPreconditionError: reason ``ARCH_UNSUPPORTED``.
    """
    if machine.strip().lower() not in SUPPORTED_MACHINES:
        raise FailedPreconditionError(
            f"machine architecture {machine!r} is not supported: CUDA checkpoint works on x86_64 only (aarch64 "
            "returns CUDA_ERROR_NOT_SUPPORTED, FC-15); run the worker on an x86_64 host",
            reason="ARCH_UNSUPPORTED",
            metadata={"machine": machine},
        )


def _by_uuid(gpus: Sequence[GpuDevice]) -> dict[str, GpuDevice]:
    return {normalize_gpu_uuid(g.uuid): g for g in gpus}


def check_no_mig(gpus: Sequence[GpuDevice], involved_uuids: Iterable[str]) -> None:
    """No involved GPU has MIG enabled (FC-14: checkpoint fails with out of memory on MIG slices).

    Args:
        gpus: the node's GPUs (NVML).
        involved_uuids: GPUs the worker uses (capture) or restores onto (restore); unknown UUIDs are ignored
            here (the GPU map check reports them).

    Raises:
        FailedPreconditionError: reason ``MIG_ENABLED``, naming the GPUs.
    """
    table = _by_uuid(gpus)
    bad = [
        table[u]
        for u in dict.fromkeys(normalize_gpu_uuid(u) for u in involved_uuids)
        if u in table and table[u].mig_mode
    ]
    if bad:
        names = ", ".join(f"{g.uuid} (index {g.index})" for g in bad)
        raise FailedPreconditionError(
            f"MIG mode is enabled on {names}; CUDA checkpoint does not support MIG (FC-14): disable it with "
            "`nvidia-smi -i <index> -mig 0` (needs a GPU reset) or use another GPU",
            reason="MIG_ENABLED",
            metadata={"gpus": ",".join(g.uuid for g in bad)},
        )


def check_mps_inactive(
    target_env: Mapping[str, str], *, pipe_dir_exists: bool, mps_daemon_running: bool = False, pid: int | None = None
) -> None:
    """MPS must not be in use (CRIU CUDA plugin README: no MPS).

    Heuristic (MPS leaves no per-process trace gpusnap can read cheaply), MPS counts as active when any of:

    * the target's environment sets ``CUDA_MPS_PIPE_DIRECTORY`` (it was configured as an MPS client);
    * the target's pipe directory (that variable, else ``/tmp/nvidia-mps``), seen from the target's mount
      namespace (``/proc/<pid>/root/…``), holds an MPS ``control`` socket — ``pipe_dir_exists``;
    * an ``nvidia-cuda-mps-control`` or ``nvidia-cuda-mps-server`` process runs on the node —
      ``mps_daemon_running``.

    Args:
        target_env: the target's environment (``/proc/<pid>/environ``).
        pipe_dir_exists: see above (``procfs.mps_pipe_dir_exists``).
        mps_daemon_running: see above (``procfs.mps_daemon_running``).
        pid: the target, for the message.

    Raises:
        FailedPreconditionError: reason ``MPS_ACTIVE``, naming which sign was found.
    """
    signs = []
    if target_env.get("CUDA_MPS_PIPE_DIRECTORY"):
        signs.append(f"its environment sets CUDA_MPS_PIPE_DIRECTORY={target_env['CUDA_MPS_PIPE_DIRECTORY']}")
    if pipe_dir_exists:
        pipe = target_env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIR
        signs.append(f"an MPS control pipe exists in {pipe}")
    if mps_daemon_running:
        signs.append("an nvidia-cuda-mps-control/server process runs on this node")
    if signs:
        who = f"process {pid}" if pid is not None else "the worker"
        raise FailedPreconditionError(
            f"CUDA MPS looks active for {who} ({'; '.join(signs)}); CUDA checkpoint does not support MPS: stop the "
            "MPS daemon (`echo quit | nvidia-cuda-mps-control`) and start the worker without CUDA_MPS_* settings",
            reason="MPS_ACTIVE",
            metadata={"pid": str(pid) if pid is not None else ""},
        )


def check_gpu_memory(need_by_target: Mapping[str, int], gpus: Sequence[GpuDevice], *, headroom_bytes: int = 0) -> None:
    """Each target GPU has the free memory its restored processes need.

    Args:
        need_by_target: bytes needed per target GPU UUID (sum over the processes restoring onto it).
        gpus: the node's GPUs (NVML), with current free memory.
        headroom_bytes: extra bytes to keep free per GPU.

    Raises:
        FailedPreconditionError: a target GPU does not exist (reason ``GPU_NOT_FOUND``).
        ResourceExhaustedError: not enough free memory (reason ``GPU_MEMORY_INSUFFICIENT``), naming the GPU,
            free and needed GiB.
    """
    table = _by_uuid(gpus)
    short = []
    for raw_uuid, need in need_by_target.items():
        uuid = normalize_gpu_uuid(raw_uuid)
        gpu = table.get(uuid)
        if gpu is None:
            raise FailedPreconditionError(
                f"GPU {uuid} is not on this node; pick a GPU listed by `nvidia-smi -L`",
                reason="GPU_NOT_FOUND",
                metadata={"gpu": uuid},
            )
        if gpu.memory_free_bytes < need + headroom_bytes:
            short.append((gpu, need + headroom_bytes))
    if short:
        detail = "; ".join(
            f"{g.uuid} (index {g.index}) has {_gib(g.memory_free_bytes)} free, needs {_gib(n)}" for g, n in short
        )
        raise ResourceExhaustedError(
            f"not enough free GPU memory: {detail}; stop other processes on those GPUs or restore onto other GPUs of "
            "the same model",
            reason="GPU_MEMORY_INSUFFICIENT",
            metadata={
                "gpus": ",".join(g.uuid for g, _ in short),
                "missing_bytes": str(sum(max(0, n - g.memory_free_bytes) for g, n in short)),
            },
        )


def check_host_memory(
    mem_available_bytes: int,
    gpu_bytes: int,
    *,
    image_bytes_in_ram: int = 0,
    headroom_bytes: int = DEFAULT_HOST_HEADROOM_BYTES,
) -> None:
    """Host RAM can take the GPU contents checkpoint stages there (plus images kept in RAM).

    ``cuCheckpointProcessCheckpoint`` copies every byte of device memory into driver-owned host memory of the
    target; with images on tmpfs the dump needs the same again (docs/cuda-checkpoint.md, "Host memory").

    Args:
        mem_available_bytes: ``MemAvailable`` of ``/proc/meminfo``, in bytes.
        gpu_bytes: device memory the CUDA processes hold (NVML), in bytes.
        image_bytes_in_ram: bytes of images that will live in RAM (tmpfs image dir: RSS + GPU), else 0.
        headroom_bytes: RAM to keep free for everything else.

    Raises:
        ResourceExhaustedError: reason ``HOST_MEMORY_INSUFFICIENT``.
    """
    need = gpu_bytes + image_bytes_in_ram + headroom_bytes
    if mem_available_bytes < need:
        raise ResourceExhaustedError(
            f"not enough host RAM: checkpoint stages {_gib(gpu_bytes)} of GPU memory in RAM"
            + (f" plus {_gib(image_bytes_in_ram)} of in-memory images" if image_bytes_in_ram else "")
            + f" and keeps {_gib(headroom_bytes)} free, but MemAvailable is {_gib(mem_available_bytes)}; free RAM, "
            "shrink the worker's GPU footprint (e.g. release the KV cache before capture) or put images on disk",
            reason="HOST_MEMORY_INSUFFICIENT",
            metadata={"mem_available_bytes": str(mem_available_bytes), "needed_bytes": str(need)},
        )


def check_no_forbidden_devices(pid: int, paths: Iterable[str]) -> None:
    """The process holds no device CRIU cannot dump: ``/dev/gdrdrv`` (FC-20), ``/dev/infiniband/*``.

    Args:
        pid: the process.
        paths: its open fd targets and mapped file paths (``procfs.open_paths``).

    Raises:
        FailedPreconditionError: reason ``FORBIDDEN_DEVICE_OPEN``, naming the device and the fix.
    """
    found: dict[str, str] = {}
    for path in paths:
        for device, fix in FORBIDDEN_DEVICES.items():
            # "/dev/gdrdrv" matches exactly; "/dev/infiniband/" matches the directory's entries.
            if path == device.rstrip("/") or (device.endswith("/") and path.startswith(device)):
                found.setdefault(path, fix)
    if found:
        devices = ", ".join(sorted(found))
        fixes = "; ".join(dict.fromkeys(found.values()))
        raise FailedPreconditionError(
            f"process {pid} has {devices} open; CRIU cannot dump it: {fixes}",
            reason="FORBIDDEN_DEVICE_OPEN",
            metadata={"pid": str(pid), "devices": ",".join(sorted(found))},
        )


def check_nccl_env(pid: int, env: Mapping[str, str], *, engine: str | None = None, tensor_parallel: int = 1) -> None:
    """A rank of a multi-process tree carries the settings that keep checkpoint from hanging (FC-05/06/07).

    Call it for every CUDA process when the tree has more than one, or when the job is tensor-parallel.
    Required: the ``MULTI_PROCESS`` rows of :data:`gpusnap.adapters.contract.capture_settings.CAPTURE_SETTINGS`
    (``NCCL_P2P_DISABLE=1``, ``NCCL_NVLS_ENABLE=0``, ``NCCL_SHM_DISABLE=1``, ``NCCL_CUMEM_HOST_ENABLE=0``)
    and, with ``tensor_parallel > 1``, the ``TENSOR_PARALLEL`` rows of ``engine`` (vLLM
    ``VLLM_ALLREDUCE_USE_SYMM_MEM=0``). ``configure_capture_env`` sets all of them.

    Args:
        pid: the rank's PID.
        env: its environment (``/proc/<pid>/environ``).
        engine: ``"vllm"``, ``"sglang"``, ``"trtllm"`` or ``None`` (unknown: no engine-specific rows).
        tensor_parallel: the job's tensor-parallel size (1 when not tensor-parallel or unknown).

    Raises:
        FailedPreconditionError: reason ``NCCL_ENV_UNSAFE``, listing every missing ``NAME=value`` and the
            failure cases behind them.
    """
    scopes = capture_settings.scopes_for(cuda_processes=2, tensor_parallel=tensor_parallel)
    missing = capture_settings.missing_env(env, scopes, engine=engine)
    if missing:
        _refuse_settings(pid, missing, "its environment lacks", "restart the worker with these variables set")


def check_engine_args(pid: int, argv: Sequence[str], *, engine: str, tensor_parallel: int) -> None:
    """The process that started a tensor-parallel engine passed the engine flags capture needs (FC-05/07).

    Args:
        pid: the process whose ``argv`` names the tensor-parallel size.
        argv: its command line.
        engine: the engine it runs (:func:`engine_from_argv`).
        tensor_parallel: the size it asked for.

    Raises:
        FailedPreconditionError: reason ``NCCL_ENV_UNSAFE``, naming each missing flag (vLLM
            ``--disable-custom-all-reduce``).
    """
    scopes = capture_settings.scopes_for(cuda_processes=2, tensor_parallel=tensor_parallel)
    missing = capture_settings.missing_engine_args(argv, scopes, engine=engine)
    if missing:
        _refuse_settings(pid, missing, f"its {engine} command line lacks", "restart the engine with these flags")


def _refuse_settings(pid: int, missing: Sequence[capture_settings.CaptureSetting], lacks: str, fix: str) -> None:
    names = [s.requirement() for s in missing]
    cases = sorted({fc for s in missing for fc in s.failure_cases})
    why = "; ".join(dict.fromkeys(s.reason for s in missing))
    raise FailedPreconditionError(
        f"process {pid} is one rank of a multi-process CUDA job but {lacks} {', '.join(names)} "
        f"({why}{'; ' + ', '.join(cases) if cases else ''}): {fix} (gpusnap.adapters.configure_capture_env sets "
        "the variables)",
        reason="NCCL_ENV_UNSAFE",
        metadata={"pid": str(pid), "missing": ",".join(names)},
    )


#: Command-line flags that give an engine's tensor-parallel size (every engine's ``settings``).
TENSOR_PARALLEL_FLAGS = registry.TENSOR_PARALLEL_FLAGS


def engine_from_argv(argv: Sequence[str]) -> str | None:
    """The engine (``"vllm"``, ``"sglang"``, ``"trtllm"``, …) whose entry point ``argv`` runs, by the markers
    each engine's ``settings`` declares (:data:`gpusnap.adapters.contract.registry.ENGINE_MARKERS`), else ``None``.

    Looks at the program and at ``-m`` module arguments only (so a model *named* after an engine does not
    count): ``vllm serve …``, ``python -m vllm.entrypoints.openai.api_server``, ``python -m sglang.launch_server``,
    ``trtllm-serve``.
    """
    candidates = [Path(argv[0]).name] if argv else []
    candidates += [argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "-m"]
    for arg in candidates:
        for marker, engine in registry.ENGINE_MARKERS:
            if arg == marker or arg.startswith(marker + ".") or arg.startswith(marker + "-"):
                return engine
    return None


def tensor_parallel_from_argv(argv: Sequence[str]) -> int:
    """The tensor-parallel size an engine command line asks for (:data:`TENSOR_PARALLEL_FLAGS`), else 1.

    Accepts ``--flag N`` and ``--flag=N``; an unparsable value counts as 1 (the engine would refuse it).
    """
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in TENSOR_PARALLEL_FLAGS:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if value.strip().isdigit():
            return max(int(value), 1)
    return 1


def check_launch_job(pid: int, env: Mapping[str, str]) -> None:
    """A rank of a multi-process CUDA tree was started under ``cuda-checkpoint --launch-job`` (FC-07).

    Processes that share CUDA IPC memory can only be checkpointed as one job: the launch wrapper exports
    ``CUDA_CHECKPOINT_JOB_FILE`` to every descendant. :func:`check_capture` runs it only when
    :attr:`CaptureFacts.require_launch_job` is set: the ``MULTI_PROCESS`` capture settings
    (:func:`check_nccl_env`) already keep NCCL from sharing CUDA IPC memory between ranks, and the launch
    wrapper needs driver >= 590, so demanding it of every multi-process tree refused workers that the
    documented settings make capturable (issue 9).

    Raises:
        FailedPreconditionError: reason ``LAUNCH_JOB_MISSING``.
    """
    if not env.get("CUDA_CHECKPOINT_JOB_FILE"):
        raise FailedPreconditionError(
            f"process {pid} is one of several CUDA processes but was not started under `cuda-checkpoint "
            "--launch-job` (no CUDA_CHECKPOINT_JOB_FILE); processes sharing CUDA IPC memory fail to restore (FC-07): "
            "launch the worker tree with it (driver >= 590; CUDA IPC checkpoint needs >= 610)",
            reason="LAUNCH_JOB_MISSING",
            metadata={"pid": str(pid)},
        )


# --------------------------------------------------------------------------------------- combined checks


@dataclass(frozen=True)
class CaptureFacts:
    """Everything :func:`check_capture` looks at, gathered before any PID is locked.

    Attributes:
        machine: ``uname -m``.
        driver_version: NVIDIA driver version (NVML), e.g. ``"580.159.04"``.
        gpus: the node's GPUs (NVML).
        gpu_uuids: GPUs the tree's CUDA processes use.
        cuda_pids: the tree's CUDA PIDs.
        env_by_pid: environment of each CUDA PID.
        open_paths_by_pid: open fd targets + mapped paths of every PID CRIU will dump.
        mem_available_bytes: host ``MemAvailable`` in bytes (``gpusnap.daemon.drivers.host.mem_available_bytes``).
        gpu_bytes: device memory the CUDA PIDs hold, in bytes.
        image_bytes_in_ram: bytes of images that will sit in RAM (tmpfs), else 0.
        mps_pipe_dir_exists: see :func:`check_mps_inactive` (per node; any CUDA PID).
        mps_daemon_running: see :func:`check_mps_inactive`.
        engine: adapter name (``"vllm"`` …) or ``None`` (then guessed from the command lines).
        cmdline_by_pid: argv of the tree's processes (engine, tensor-parallel size and engine flags).
        tensor_parallel: the job's tensor-parallel size when known (e.g. from the ranks' agents); 0 = read it
            from ``cmdline_by_pid`` (:func:`tensor_parallel_from_argv`).
        require_launch_job: also refuse multi-process trees not started under ``--launch-job`` (FC-07), for
            trees known to share CUDA IPC memory outside NCCL.
    """

    machine: str
    driver_version: str
    gpus: Sequence[GpuDevice]
    gpu_uuids: Sequence[str]
    cuda_pids: Sequence[int]
    env_by_pid: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    open_paths_by_pid: Mapping[int, Sequence[str]] = field(default_factory=dict)
    mem_available_bytes: int = 0
    gpu_bytes: int = 0
    image_bytes_in_ram: int = 0
    mps_pipe_dir_exists: bool = False
    mps_daemon_running: bool = False
    engine: str | None = None
    cmdline_by_pid: Mapping[int, Sequence[str]] = field(default_factory=dict)
    tensor_parallel: int = 0
    require_launch_job: bool = False


@dataclass(frozen=True)
class RestoreFacts:
    """Everything :func:`check_restore` looks at, gathered before CRIU restore.

    Attributes:
        machine: ``uname -m``.
        driver_version: NVIDIA driver version (NVML).
        gpus: the node's GPUs (NVML), with current free memory.
        gpu_map: resolved ``old_uuid -> new_uuid`` (:func:`~gpusnap.daemon.gpu.gpumap.resolve_gpu_map`).
        required_free_bytes: bytes needed per *source* GPU UUID (the snapshot's ``GpuProcess`` records).
        mem_available_bytes: host ``MemAvailable`` in bytes.
        image_bytes: bytes CRIU will read back into RAM (RSS + staged GPU memory), 0 to skip.
        mps_daemon_running: see :func:`check_mps_inactive`.
    """

    machine: str
    driver_version: str
    gpus: Sequence[GpuDevice]
    gpu_map: Mapping[str, str]
    required_free_bytes: Mapping[str, int] = field(default_factory=dict)
    mem_available_bytes: int = 0
    image_bytes: int = 0
    mps_daemon_running: bool = False


def _run_all(checks: Sequence[tuple[str, Callable[[], None]]]) -> None:
    errors: list[GpusnapError] = []
    for _name, thunk in checks:
        try:
            thunk()
        except GpusnapError as exc:
            errors.append(exc)
    if not errors:
        return
    if len(errors) == 1:
        raise errors[0]
    raise FailedPreconditionError(
        f"{len(errors)} preflight checks failed: " + " | ".join(e.message for e in errors),
        reason="PREFLIGHT_FAILED",
        metadata={"reasons": ",".join(e.reason for e in errors)},
    )


def check_capture(facts: CaptureFacts) -> None:
    """Run every capture check and report all failures together.

    Order: machine, driver (≥ 570), MIG on the used GPUs, MPS, forbidden devices per PID, capture settings
    per rank (when more than one CUDA PID or a tensor-parallel size above 1; launch-job only when
    required), engine flags of a tensor-parallel launcher, host RAM.

    Raises:
        FailedPreconditionError / ResourceExhaustedError: the single failing check's error, or
            ``FailedPreconditionError`` reason ``PREFLIGHT_FAILED`` (metadata ``reasons``) when several fail.
    """
    checks: list[tuple[str, Callable[[], None]]] = [
        ("machine", lambda: check_machine(facts.machine)),
        ("driver", lambda: check_driver_version(facts.driver_version)),
        ("mig", lambda: check_no_mig(facts.gpus, facts.gpu_uuids)),
    ]
    # MPS: judge by the first CUDA PID whose environment names an MPS pipe directory, else the first CUDA PID.
    mps_pid = next(
        (p for p in facts.cuda_pids if facts.env_by_pid.get(p, {}).get("CUDA_MPS_PIPE_DIRECTORY")),
        facts.cuda_pids[0] if facts.cuda_pids else None,
    )
    mps_env = facts.env_by_pid.get(mps_pid, {}) if mps_pid is not None else {}
    checks.append(
        (
            "mps",
            partial(
                check_mps_inactive,
                mps_env,
                pipe_dir_exists=facts.mps_pipe_dir_exists,
                mps_daemon_running=facts.mps_daemon_running,
                pid=mps_pid,
            ),
        )
    )
    for pid, paths in facts.open_paths_by_pid.items():
        checks.append((f"devices:{pid}", partial(check_no_forbidden_devices, pid, paths)))
    launcher = _tensor_parallel_launcher(facts.cmdline_by_pid)
    tp = facts.tensor_parallel or (launcher[1] if launcher else 1)
    engine = facts.engine or (launcher[2] if launcher else None) or _engine_of(facts.cmdline_by_pid.values())
    if len(facts.cuda_pids) > 1 or tp > 1:
        for pid in facts.cuda_pids:
            env = facts.env_by_pid.get(pid, {})
            checks.append((f"nccl:{pid}", partial(check_nccl_env, pid, env, engine=engine, tensor_parallel=tp)))
            if facts.require_launch_job:
                checks.append((f"launch_job:{pid}", partial(check_launch_job, pid, env)))
    launched = launcher[2] if launcher is not None else None
    if launcher is not None and launched is not None and tp > 1:
        argv = facts.cmdline_by_pid[launcher[0]]
        checks.append(
            (
                f"engine_args:{launcher[0]}",
                partial(check_engine_args, launcher[0], argv, engine=launched, tensor_parallel=tp),
            )
        )
    checks.append(
        (
            "host_memory",
            lambda: check_host_memory(
                facts.mem_available_bytes, facts.gpu_bytes, image_bytes_in_ram=facts.image_bytes_in_ram
            ),
        )
    )
    _run_all(checks)


def _tensor_parallel_launcher(cmdlines: Mapping[int, Sequence[str]]) -> tuple[int, int, str | None] | None:
    """(pid, tensor-parallel size, engine) of the first command line asking for a size above 1, else ``None``."""
    for pid, argv in cmdlines.items():
        size = tensor_parallel_from_argv(argv)
        if size > 1:
            return pid, size, engine_from_argv(argv)
    return None


def _engine_of(cmdlines: Iterable[Sequence[str]]) -> str | None:
    return next((e for e in map(engine_from_argv, cmdlines) if e), None)


def check_restore(facts: RestoreFacts) -> None:
    """Run every restore check and report all failures together.

    Order: machine, driver (≥ 580 if any pair is not identity, else ≥ 570), MIG on targets, MPS daemon, free
    memory on each target GPU, host RAM for the images (when ``image_bytes`` > 0).

    Raises:
        As :func:`check_capture`.
    """
    pairs = {normalize_gpu_uuid(k): normalize_gpu_uuid(v) for k, v in facts.gpu_map.items()}
    remapping = any(k != v for k, v in pairs.items())
    need: dict[str, int] = {}
    for raw_src, nbytes in facts.required_free_bytes.items():
        src = normalize_gpu_uuid(raw_src)
        target = pairs.get(src, src)
        need[target] = need.get(target, 0) + nbytes
    checks: list[tuple[str, Callable[[], None]]] = [
        ("machine", lambda: check_machine(facts.machine)),
        ("driver", lambda: check_driver_version(facts.driver_version, remapping=remapping)),
        ("mig", lambda: check_no_mig(facts.gpus, pairs.values())),
        ("mps", lambda: check_mps_inactive({}, pipe_dir_exists=False, mps_daemon_running=facts.mps_daemon_running)),
        ("gpu_memory", lambda: check_gpu_memory(need, facts.gpus)),
    ]
    if facts.image_bytes:
        checks.append(("host_memory", lambda: check_host_memory(facts.mem_available_bytes, facts.image_bytes)))
    _run_all(checks)


def check_tree(
    gpu: GpuSupport,
    tree: GpuTree,
    tree_pids: Iterable[int],
    reported_env: Mapping[int, Mapping[str, str]] | None = None,
) -> None:
    """Every capture precondition of a tree's CUDA side (driver, MIG, MPS, devices, capture settings, host RAM),
    its facts gathered from ``gpu`` and ``/proc``, before anything is locked (:func:`check_capture`).

    Args:
        tree: the tree's CUDA side (``GpuSupport.find_tree``).
        tree_pids: every PID of the tree.
        reported_env: capture settings agents reported for their processes (``AgentRegistry.capture_env``),
            laid over ``/proc/<pid>/environ``, which shows only the environment at exec.
    """
    tree_pids = list(tree_pids)
    reported_env = reported_env or {}
    driver, _ = gpu.driver_versions()
    facts = CaptureFacts(
        machine=host.machine(),
        driver_version=driver,
        gpus=gpu.gpus(),
        gpu_uuids=tree.uuids,
        cuda_pids=tree.cuda_pids,
        env_by_pid={p: procfs.effective_environ(p, reported_env.get(p, {})) for p in tree.cuda_pids},
        open_paths_by_pid={p: procfs.open_paths(p) for p in tree_pids},
        cmdline_by_pid={p: procfs.read_cmdline(p) for p in tree_pids},
        mem_available_bytes=gpu.host_memory(),
        gpu_bytes=tree.gpu_bytes,
        mps_daemon_running=procfs.mps_daemon_running(),
    )
    check_capture(facts)
