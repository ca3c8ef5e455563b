"""The one table of capture settings: what a worker sets so that it can be checkpointed, and why.

Three readers use this table and nothing else: :func:`gpusnap.adapters.env.configure_capture_env` (sets
the environment defaults inside the worker), the vLLM plugin (sets them, and the engine arguments, in
every vLLM process before the engine is built), and the daemon's preflight
(``gpusnap.daemon.preflight.gpu.check_nccl_env``), which refuses a tree whose CUDA processes lack what
their layout needs. A worker configured with the helper therefore passes preflight whatever its layout.

Each :class:`CaptureSetting` has a :class:`Scope`:

* ``ANY``: every worker; the helper sets it, preflight does not require it (a single CUDA process
  captures without it, the setting only removes things that get in the way).
* ``MULTI_PROCESS``: required of every CUDA process of a tree that has several (front end + worker,
  data-parallel ranks, tensor-parallel ranks). These switch off NCCL's transports between processes that
  share GPU or host memory the checkpoint cannot carry; in a process that never talks NCCL to a peer they
  change nothing, so the helper always sets them.
* ``TENSOR_PARALLEL``: engine features that only a tensor-parallel group uses (custom all-reduce and
  symmetric memory over CUDA IPC); the helper sets them when asked for ``tensor_parallel > 1``,
  preflight requires them of a job it knows to be tensor-parallel.

The rows every engine shares are here (:data:`COMMON_SETTINGS`); each engine's own rows are in its folder
(``gpusnap.adapters.engines.<name>.settings``), collected by :mod:`gpusnap.adapters.contract.registry`.
Failure cases (``FC-xx``) are described in ``docs/failure-cases.md``. This module imports only the
standard library and the engines' ``settings`` modules: it runs inside engine processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpusnap.adapters.contract import registry
from gpusnap.adapters.contract.settings import CaptureSetting, Kind, Scope

__all__ = [
    "CAPTURE_SETTINGS",
    "COMMON_SETTINGS",
    "CaptureSetting",
    "Kind",
    "Scope",
    "engine_args",
    "env_defaults",
    "missing_engine_args",
    "missing_env",
    "report",
    "reported",
    "scopes_for",
    "settings",
]


_S = CaptureSetting
COMMON_SETTINGS: tuple[CaptureSetting, ...] = (
    # --- every worker ---------------------------------------------------------------------------------
    _S(
        "NCCL_CUMEM_ENABLE",
        "0",
        "NCCL then allocates with cudaMalloc and exports no cuMem handles (file "
        "descriptors) to peer processes, which is CUDA IPC memory the checkpoint cannot carry",
        failure_cases=("FC-07",),
    ),
    _S("NCCL_IB_DISABLE", "1", "InfiniBand verbs state (/dev/infiniband) cannot enter a CRIU image"),
    _S("NCCL_RAS_ENABLE", "0", "NCCL's RAS thread keeps sockets open between ranks"),
    _S("TORCH_NCCL_ENABLE_MONITORING", "0", "the NCCL watchdog kills processes that were frozen for the dump"),
    _S("TORCH_NCCL_DUMP_ON_TIMEOUT", "0", "same watchdog: no dumps over the gap between capture and restore"),
    _S("HF_HUB_OFFLINE", "1", "no hub connections may be open in the image"),
    _S("HF_HUB_DISABLE_XET", "1", "the Xet client keeps background connections"),
    _S("TORCHINDUCTOR_COMPILE_THREADS", "1", "no compile worker pool processes in the image"),
    _S(
        "GLOO_SOCKET_IFNAME",
        "lo",
        "gloo's listening sockets bind to loopback, not the node's address, so a restore in a private network "
        "namespace or on another node can bind them again (a job spanning nodes sets its own interface)",
    ),
    # --- several CUDA processes: no transport between processes that the checkpoint cannot carry -------
    _S(
        "NCCL_P2P_DISABLE",
        "1",
        "the P2P transport maps peer GPU memory over CUDA IPC; checkpoint hangs on it and "
        "IPC memory cannot be restored per process",
        Scope.MULTI_PROCESS,
        ("FC-05", "FC-07"),
    ),
    _S(
        "NCCL_NVLS_ENABLE",
        "0",
        "NVLink SHARP multicast objects span processes and cannot be checkpointed",
        Scope.MULTI_PROCESS,
        ("FC-05",),
    ),
    _S(
        "NCCL_SHM_DISABLE",
        "1",
        "the SHM transport shares host buffers between ranks; checkpoint and restore hang on it",
        Scope.MULTI_PROCESS,
        ("FC-05", "FC-06"),
    ),
    _S(
        "NCCL_CUMEM_HOST_ENABLE",
        "0",
        "cuMem host allocations behind the SHM transport hang restore in ncclCheckpointRestore",
        Scope.MULTI_PROCESS,
        ("FC-06",),
    ),
)
"""The rows every engine shares (``engine`` None); each engine's own are in its folder's ``settings``."""
del _S

CAPTURE_SETTINGS: tuple[CaptureSetting, ...] = COMMON_SETTINGS + tuple(r for e in registry.ENGINES for r in e.rows)
"""Every capture setting: the common rows, then each engine's (:data:`registry.ENGINES`), in the order the
helper applies them."""


def scopes_for(*, cuda_processes: int, tensor_parallel: int) -> frozenset[Scope]:
    """The scopes a layout requires (``ANY`` rows are never required).

    Args:
        cuda_processes: CUDA processes in the tree (≥ 0).
        tensor_parallel: tensor-parallel size of the job (1 when not tensor-parallel or unknown).

    Returns:
        ``MULTI_PROCESS`` with several CUDA processes or ``tensor_parallel > 1``; ``TENSOR_PARALLEL`` with
        ``tensor_parallel > 1``; else empty.
    """
    scopes: set[Scope] = set()
    if cuda_processes > 1 or tensor_parallel > 1:
        scopes.add(Scope.MULTI_PROCESS)
    if tensor_parallel > 1:
        scopes.add(Scope.TENSOR_PARALLEL)
    return frozenset(scopes)


def settings(
    scopes: Iterable[Scope], *, engine: str | None = None, kind: Kind | None = None
) -> tuple[CaptureSetting, ...]:
    """Rows of :data:`CAPTURE_SETTINGS` in ``scopes``.

    Args:
        scopes: the scopes wanted.
        engine: keep engine-specific rows only for this engine; ``None`` keeps every engine's rows.
        kind: only rows of this kind; ``None`` keeps both.
    """
    wanted = frozenset(scopes)
    return tuple(
        s
        for s in CAPTURE_SETTINGS
        if s.scope in wanted
        and (engine is None or s.engine is None or s.engine == engine)
        and (kind is None or s.kind is kind)
    )


def env_defaults(*, tensor_parallel: int = 1, engine: str | None = None) -> dict[str, str]:
    """The environment a worker should start with: ``ANY`` and ``MULTI_PROCESS`` rows always (inert in a
    process without NCCL peers), ``TENSOR_PARALLEL`` rows when ``tensor_parallel > 1``.

    Args:
        tensor_parallel: the worker's tensor-parallel size (≥ 1).
        engine: the engine, to leave out other engines' rows; ``None`` keeps them all.

    Raises:
        ValueError: ``tensor_parallel < 1``.
    """
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    scopes = scopes_for(cuda_processes=2, tensor_parallel=tensor_parallel) | {Scope.ANY}
    return {s.name: s.value for s in settings(scopes, engine=engine, kind=Kind.ENV)}


def engine_args(engine: str, *, tensor_parallel: int = 1) -> dict[str, str]:
    """Engine arguments a captured worker of ``engine`` needs: engine-args field → flag (e.g. vLLM
    ``{"disable_custom_all_reduce": "--disable-custom-all-reduce"}`` at ``tensor_parallel > 1``)."""
    scopes = scopes_for(cuda_processes=2, tensor_parallel=tensor_parallel)
    return {s.engine_field: s.name for s in settings(scopes, engine=engine, kind=Kind.ENGINE_ARG)}


def missing_env(env: Mapping[str, str], scopes: Iterable[Scope], *, engine: str | None) -> list[CaptureSetting]:
    """Environment rows of ``scopes`` that ``env`` lacks or sets to another value (whitespace ignored).

    Args:
        env: a process's environment (e.g. ``/proc/<pid>/environ``).
        scopes: what its layout needs (:func:`scopes_for`).
        engine: the tree's engine; ``None`` means unknown, and engine-specific rows are then not required.
    """
    return [
        s
        for s in settings(scopes, kind=Kind.ENV)
        if (s.engine is None or s.engine == engine) and env.get(s.name, "").strip() != s.value
    ]


def missing_engine_args(argv: Iterable[str], scopes: Iterable[Scope], *, engine: str) -> list[CaptureSetting]:
    """Engine-argument rows of ``scopes`` for ``engine`` absent from ``argv`` (``--flag`` or ``--flag=…``)."""
    args = list(argv)
    return [
        s
        for s in settings(scopes, engine=engine, kind=Kind.ENGINE_ARG)
        if s.engine == engine and not any(a == s.name or a.startswith(s.name + "=") for a in args)
    ]


def report(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment rows of the table that ``environ`` sets (``NAME → value``), for the agent's hello
    (``AgentHello.capture_env``).

    ``/proc/<pid>/environ`` shows a process's environment as it was at exec, so variables that
    :func:`~gpusnap.adapters.env.configure_capture_env` set inside the process (which NCCL, reading
    ``getenv`` later, does see) are missing there; the agent reports them instead. Only names of the table
    are reported.
    """
    names = {s.name for s in CAPTURE_SETTINGS if s.kind is Kind.ENV}
    return {k: v for k, v in environ.items() if k in names}


def reported(env: Mapping[str, str]) -> dict[str, str]:
    """What the daemon takes of an agent's :func:`report`: the table's names only (the agent is not trusted)."""
    return report(env)
