"""Choose the GPU each checkpointed GPU is restored onto, and validate user-given maps (FC-08, FC-09, FC-11).

Driver rules (``cuCheckpointProcessRestore``): the target must be the same chip type with enough free memory;
a pair list, if given, must contain **every** checkpointed GPU. cuda-python's tests found that even an identity
map fails when only some GPUs are visible, so gpusnap builds the list by UUID over all checkpointed GPUs and
keeps every GPU visible to the worker.

:func:`resolve_gpu_map` returns the full ``old → new`` map (identity entries included).
:func:`gpu_pairs_for_restore` turns it into the ``gpuPairs`` argument: **empty when every entry is identity**
(as Dynamo does), otherwise **every** entry, identity ones included (the driver rejects partial lists, FC-08).
Callers must not simply drop identity pairs from a mixed map.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gpusnap.daemon.api.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from gpusnap.daemon.api.types import GpuProcess
from gpusnap.daemon.api.validate import shown
from gpusnap.daemon.drivers.cuda import normalize_gpu_uuid
from gpusnap.daemon.drivers.nvml import GpuDevice

_GIB = float(1 << 30)


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"


MAX_GPU_MAP = 64
"""Entries a GPU map may have (a node has far fewer GPUs)."""


def check_form(requested: Mapping[str, str]) -> None:
    """Refuse a GPU map that is malformed whatever GPUs this node has, before any operation starts: more
    than ``MAX_GPU_MAP`` entries, or a key or value that is neither an index (at most 3 digits) nor a GPU
    UUID. (Whether the GPUs exist here is checked later, against NVML: :func:`resolve_gpu_map`.)

    Raises:
        InvalidArgumentError: ``INVALID_GPU_MAP`` (too many entries, an empty or overlong one), or
            ``INVALID_GPU_UUID`` (naming the entry).
    """
    if len(requested) > MAX_GPU_MAP:
        raise InvalidArgumentError(
            f"a GPU map of {len(requested)} entries (at most {MAX_GPU_MAP}); give one OLD=NEW per GPU of the snapshot",
            reason="INVALID_GPU_MAP",
        )
    for ref in (*requested.keys(), *requested.values()):
        text = ref.strip()
        if text.isdigit() and len(text) <= 3:
            continue
        if not text or len(text) > 64:
            raise InvalidArgumentError(
                f"GPU map entry {shown(ref)} is neither a GPU index nor a GPU UUID (GPU-xxxxxxxx-…, `nvidia-smi -L`)",
                reason="INVALID_GPU_MAP",
            )
        normalize_gpu_uuid(text)


def _gpu_ref(gpus: Sequence[GpuDevice], text: str, *, role: str) -> GpuDevice | None:
    """Resolve a UUID or an index (``"0"``) to a GPU of this node; ``None`` for an unknown UUID."""
    ref = text.strip()
    if ref.isdigit():
        for gpu in gpus:
            if gpu.index == int(ref):
                return gpu
        raise InvalidArgumentError(
            f"{role} GPU index {ref} does not exist on this node (indexes: "
            f"{', '.join(str(g.index) for g in gpus) or 'none'}); use an index or UUID from `nvidia-smi -L`",
            reason="GPU_NOT_FOUND",
            metadata={"gpu": ref},
        )
    uuid = normalize_gpu_uuid(ref)
    for gpu in gpus:
        if normalize_gpu_uuid(gpu.uuid) == uuid:
            return gpu
    return None


def resolve_gpu_map(
    requested: Mapping[str, str],
    checkpointed_uuids: Sequence[str],
    gpus: Sequence[GpuDevice],
    *,
    required_free_bytes: Mapping[str, int],
    source_models: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Decide where each checkpointed GPU is restored.

    Keys and values of ``requested`` may be GPU UUIDs (``"GPU-…"``, any case) or NVML indexes of **this** node
    (``"0"``). An index key names the checkpointed GPU through this node's GPU list, so it only works when
    restoring on the capturing host; use UUIDs otherwise.

    With ``requested`` empty: identity for every checkpointed GPU present here with enough free memory and no
    MIG; the others get distinct GPUs of the same model (fewest compute processes, then lowest index) that
    have enough free memory and are not used by another pair.

    Args:
        requested: user map ``old → new``; empty = choose automatically. When given it must cover every
            checkpointed GPU (FC-08), identity included.
        checkpointed_uuids: UUIDs of the GPUs the snapshot's processes used (``GpuProcess.gpu_uuids``).
        gpus: this node's GPUs (NVML), with current free memory and processes.
        required_free_bytes: bytes needed per checkpointed GPU UUID (sum of ``GpuProcess.gpu_memory_bytes`` on
            it); missing = 0.
        source_models: product name of each checkpointed GPU (``GpuInfo.name`` at capture); when a source is
            absent from it, the name of the same-UUID GPU on this node is used, if any.

    Returns:
        ``{old_uuid: new_uuid}`` for every checkpointed GPU, canonical lowercase ``GPU-…`` strings.

    Raises:
        InvalidArgumentError: malformed UUID or index, a key that is not a checkpointed GPU, an incomplete map
            (reason ``GPU_MAP_INCOMPLETE``), two sources on one target (``GPU_MAP_DUPLICATE_TARGET``), a target
            of another model (``GPU_MODEL_MISMATCH``), an unknown target (``GPU_NOT_FOUND``).
        FailedPreconditionError: a target has MIG enabled (``MIG_ENABLED``); no GPU of the right model is
            available for an automatic choice (``NO_SUITABLE_GPU``); the source model is unknown for a GPU that
            must move (``GPU_MODEL_UNKNOWN``).
        ResourceExhaustedError: a target lacks free memory (``GPU_MEMORY_INSUFFICIENT``).
    """
    sources = list(dict.fromkeys(normalize_gpu_uuid(u) for u in checkpointed_uuids))
    need = {normalize_gpu_uuid(k): int(v) for k, v in required_free_bytes.items()}
    by_uuid = {normalize_gpu_uuid(g.uuid): g for g in gpus}
    models = {normalize_gpu_uuid(k): v for k, v in (source_models or {}).items()}

    def model_of(src: str) -> str | None:
        if src in models:
            return models[src]
        local = by_uuid.get(src)
        return local.name if local is not None else None

    if requested:
        return _validate_requested(requested, sources, gpus, need, model_of)
    return _choose(sources, gpus, by_uuid, need, model_of)


def _validate_requested(
    requested: Mapping[str, str],
    sources: Sequence[str],
    gpus: Sequence[GpuDevice],
    need: Mapping[str, int],
    model_of: Callable[[str], str | None],
) -> dict[str, str]:
    result: dict[str, str] = {}
    for raw_key, raw_value in requested.items():
        key_gpu = _gpu_ref(gpus, raw_key, role="source")
        if raw_key.strip().isdigit():
            assert key_gpu is not None
            src = normalize_gpu_uuid(key_gpu.uuid)
            if src not in sources:
                raise InvalidArgumentError(
                    f"source GPU index {raw_key.strip()} is {key_gpu.uuid} on this node, which the snapshot did not "
                    f"use (it used {', '.join(sources)}); name sources by UUID",
                    reason="GPU_NOT_CHECKPOINTED",
                    metadata={"gpu": src},
                )
        else:
            src = normalize_gpu_uuid(raw_key)
            if src not in sources:
                raise InvalidArgumentError(
                    f"GPU {src} in the map was not used by the snapshot (it used {', '.join(sources)}); map only "
                    "checkpointed GPUs",
                    reason="GPU_NOT_CHECKPOINTED",
                    metadata={"gpu": src},
                )
        if src in result:
            raise InvalidArgumentError(
                f"GPU {src} is mapped twice; give each checkpointed GPU one target",
                reason="GPU_MAP_DUPLICATE_SOURCE",
                metadata={"gpu": src},
            )
        target = _gpu_ref(gpus, raw_value, role="target")
        if target is None:
            raise InvalidArgumentError(
                f"target GPU {normalize_gpu_uuid(raw_value)} (for {src}) is not on this node; pick one from "
                "`nvidia-smi -L`",
                reason="GPU_NOT_FOUND",
                metadata={"gpu": normalize_gpu_uuid(raw_value)},
            )
        result[src] = normalize_gpu_uuid(target.uuid)
    missing = [s for s in sources if s not in result]
    if missing:
        raise InvalidArgumentError(
            f"the GPU map does not cover checkpointed GPU(s) {', '.join(missing)}; the driver needs a target for "
            "every checkpointed GPU (FC-08): add `<uuid>=<target>` for each (identity included), or give no map "
            "to let gpusnap choose",
            reason="GPU_MAP_INCOMPLETE",
            metadata={"missing": ",".join(missing)},
        )
    targets: dict[str, str] = {}
    for src, dst in result.items():
        if dst in targets:
            raise InvalidArgumentError(
                f"GPUs {targets[dst]} and {src} both map to {dst}; each checkpointed GPU needs its own target",
                reason="GPU_MAP_DUPLICATE_TARGET",
                metadata={"gpu": dst},
            )
        targets[dst] = src
    by_uuid = {normalize_gpu_uuid(g.uuid): g for g in gpus}
    short = []
    for src, dst in result.items():
        gpu = by_uuid[dst]
        model = model_of(src)
        if model is not None and gpu.name != model:
            raise InvalidArgumentError(
                f"GPU {src} was a {model} but target {dst} (index {gpu.index}) is a {gpu.name}; restore needs the "
                "same GPU model (FC-08): pick a target of the same model",
                reason="GPU_MODEL_MISMATCH",
                metadata={"source": src, "target": dst},
            )
        if gpu.mig_mode:
            raise FailedPreconditionError(
                f"target GPU {dst} (index {gpu.index}) has MIG enabled; CUDA checkpoint does not support MIG "
                "(FC-14): disable MIG or pick another GPU",
                reason="MIG_ENABLED",
                metadata={"gpu": dst},
            )
        if gpu.memory_free_bytes < need.get(src, 0):
            short.append((src, gpu))
    if short:
        detail = "; ".join(
            f"{g.uuid} (index {g.index}, for {s}) has {_gib(g.memory_free_bytes)} free, needs {_gib(need[s])}"
            for s, g in short
        )
        raise ResourceExhaustedError(
            f"not enough free GPU memory: {detail}; free memory on those GPUs or map to other GPUs of the same model",
            reason="GPU_MEMORY_INSUFFICIENT",
            metadata={
                "gpus": ",".join(g.uuid for _, g in short),
                "missing_bytes": str(sum(max(0, need[s] - g.memory_free_bytes) for s, g in short)),
            },
        )
    return result


def _choose(
    sources: Sequence[str],
    gpus: Sequence[GpuDevice],
    by_uuid: Mapping[str, GpuDevice],
    need: Mapping[str, int],
    model_of: Callable[[str], str | None],
) -> dict[str, str]:
    result: dict[str, str] = {}
    used: set[str] = set()
    # Pass 1: identity where the original GPU is here and can take the process back.
    for src in sources:
        gpu = by_uuid.get(src)
        if gpu is not None and not gpu.mig_mode and gpu.memory_free_bytes >= need.get(src, 0):
            result[src] = src
            used.add(src)
    # Pass 2: the rest move to free GPUs of the same model.
    for src in sources:
        if src in result:
            continue
        model = model_of(src)
        if model is None:
            raise FailedPreconditionError(
                f"GPU {src} is not on this node and its model is unknown, so gpusnap cannot pick a replacement; "
                "pass an explicit GPU map (old=new) naming a GPU of the same model",
                reason="GPU_MODEL_UNKNOWN",
                metadata={"gpu": src},
            )
        candidates = sorted(
            (
                g
                for g in gpus
                if g.name == model
                and not g.mig_mode
                and normalize_gpu_uuid(g.uuid) not in used
                and normalize_gpu_uuid(g.uuid) not in sources  # a checkpointed GPU stays reserved for itself
            ),
            key=lambda g: (len(g.processes), g.index),
        )
        fitting = [g for g in candidates if g.memory_free_bytes >= need.get(src, 0)]
        if not fitting:
            here = by_uuid.get(src)
            why = (
                f"its own GPU has {_gib(here.memory_free_bytes)} free, needs {_gib(need.get(src, 0))}"
                if here is not None and not here.mig_mode
                else ("its own GPU has MIG enabled" if here is not None else "it is not on this node")
            )
            others = (
                "; ".join(f"{g.uuid} (index {g.index}) has {_gib(g.memory_free_bytes)} free" for g in candidates)
                or "none"
            )
            err_cls = (
                ResourceExhaustedError
                if candidates or (here is not None and not here.mig_mode)
                else FailedPreconditionError
            )
            raise err_cls(
                f"no {model} GPU can take checkpointed GPU {src} ({why}; other free {model} GPUs: {others}); free GPU "
                f"memory, or restore on a node with a free {model}",
                reason="GPU_MEMORY_INSUFFICIENT" if err_cls is ResourceExhaustedError else "NO_SUITABLE_GPU",
                metadata={
                    "gpu": src,
                    "model": model,
                    "needed_bytes": str(need.get(src, 0)),
                    "free_bytes": str(max((g.memory_free_bytes for g in candidates), default=0)),
                },
            )
        chosen = normalize_gpu_uuid(fitting[0].uuid)
        result[src] = chosen
        used.add(chosen)
    return result


def complete_bijection(
    gpu_map: Mapping[str, str], visible_uuids: Sequence[str], gpus: Sequence[GpuDevice]
) -> dict[str, str]:
    """Extend ``gpu_map`` to a one-to-one map over every GPU the process could see.

    The driver takes a remap only as a permutation of the visible devices: restoring GPU A onto B while B
    is also visible to the process fails with ``CUDA_ERROR_INVALID_VALUE`` unless B is mapped too
    (gpusnap measurement on 2×H200, driver 580.159.04; CRIU PR #2836's example maps every GPU, e.g.
    ``GPU0=GPU1,GPU1=GPU0``). Unmapped GPUs keep their place when it is free, otherwise they take the
    places vacated, in order (so ``{A: B}`` over ``{A, B}`` becomes the swap ``{A: B, B: A}``).

    Args:
        gpu_map: resolved ``old → new`` for the GPUs that hold state (:func:`resolve_gpu_map`).
        visible_uuids: every GPU the process could see at capture.
        gpus: this node's GPUs.

    Returns:
        ``old → new`` over ``visible_uuids`` ∪ ``gpu_map``; unchanged when it needs no completion.

    Raises:
        FailedPreconditionError: not enough GPUs here to give each visible GPU its own place (reason
            ``NO_SUITABLE_GPU``).
    """
    out = {normalize_gpu_uuid(k): normalize_gpu_uuid(v) for k, v in gpu_map.items()}
    if all(k == v for k, v in out.items()):
        return out  # identity: the driver needs no pairs at all
    sources = list(dict.fromkeys([*out, *(normalize_gpu_uuid(u) for u in visible_uuids)]))
    here = [normalize_gpu_uuid(g.uuid) for g in gpus]
    taken = set(out.values())
    for src in sources:
        if src not in out and src in here and src not in taken:
            out[src] = src
            taken.add(src)
    vacated = [u for u in here if u not in taken]
    for src in sources:
        if src not in out:
            if not vacated:
                raise FailedPreconditionError(
                    f"cannot give each of the {len(sources)} GPUs the process could see its own GPU here; "
                    "restore on a node with as many GPUs or pass a complete --gpu-map",
                    reason="NO_SUITABLE_GPU",
                )
            out[src] = vacated.pop(0)
            taken.add(out[src])
    return out


def memory_needed(processes: Sequence[GpuProcess]) -> dict[str, int]:
    """Bytes of device memory the processes held per GPU UUID (a process's bytes split evenly over its GPUs)."""
    need: dict[str, int] = {}
    for g in processes:
        for uuid in g.gpu_uuids:
            need[uuid] = need.get(uuid, 0) + g.gpu_memory_bytes // max(1, len(g.gpu_uuids))
    return need


def resolve_for_processes(
    requested: Mapping[str, str], processes: Sequence[GpuProcess], gpus: Sequence[GpuDevice]
) -> tuple[dict[str, str], dict[str, int]]:
    """Where the GPUs of checkpointed ``processes`` go on this node, and the memory each needs.

    :func:`resolve_gpu_map` over the GPUs they held, completed by :func:`complete_bijection` over every GPU
    they could see.

    Returns:
        ``(old → new map, bytes needed per old GPU UUID)``.

    Raises:
        As :func:`resolve_gpu_map` and :func:`complete_bijection`.
    """
    need = memory_needed(processes)
    uuids = list(dict.fromkeys(u for g in processes for u in g.gpu_uuids))
    resolved = resolve_gpu_map(requested, uuids, gpus, required_free_bytes=need) if uuids or requested else {}
    visible = [u for g in processes for u in g.visible_gpu_uuids]
    return complete_bijection(resolved, visible, gpus), need


def pairs_for_process(gpu_map: Mapping[str, str], visible_uuids: Sequence[str]) -> dict[str, str]:
    """The part of a node-wide map that concerns one process: the GPUs it could see (all when unknown)."""
    if not visible_uuids:
        return dict(gpu_map)
    visible = {normalize_gpu_uuid(u) for u in visible_uuids}
    return {k: v for k, v in gpu_map.items() if normalize_gpu_uuid(k) in visible}


def gpu_pairs_for_restore(gpu_map: Mapping[str, str]) -> list[tuple[str, str]]:
    """The ``gpuPairs`` argument for :meth:`CudaCheckpointApi.restore` from a resolved map.

    Args:
        gpu_map: ``old → new`` from :func:`resolve_gpu_map` (every checkpointed GPU).

    Returns:
        ``[]`` when every entry is identity (restore onto the original GPUs, as Dynamo does); otherwise every
        entry sorted by old UUID, **identity entries included**, because a non-empty list must cover every
        checkpointed GPU (FC-08).
    """
    pairs = sorted((normalize_gpu_uuid(k), normalize_gpu_uuid(v)) for k, v in gpu_map.items())
    if all(old == new for old, new in pairs):
        return []
    return pairs
