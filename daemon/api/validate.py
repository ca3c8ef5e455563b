"""Validation of names, ids, labels and PIDs received from callers."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from gpusnap.daemon.api.errors import InvalidArgumentError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
SNAPSHOT_ID_RE = re.compile(r"^snap-[a-z2-7]{26}$")
OPERATION_ID_RE = re.compile(r"^op-[a-z2-7]{26}$")
STANDBY_ID_RE = re.compile(r"^sb-[a-z2-7]{26}$")
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,126}[A-Za-z0-9])?$")
MAX_LABEL_VALUE = 256
RESERVED_LABEL_PREFIX = "gpusnap.dev/"
MAX_LABELS = 64
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
CONTEXT_KEY_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._/-]{0,126}[A-Za-z0-9_])?$")
MAX_CONTEXT_ENTRIES = 256
MAX_CONTEXT_VALUE = 32 << 10
MAX_CONTEXT_BYTES = 256 << 10


def _shown(value: str) -> str:
    """``value`` quoted for an error message, cut to 100 characters (callers may send megabytes)."""
    return repr(value) if len(value) <= 100 else repr(value[:100]) + "…"


shown = _shown


OWNED_REF_RE = re.compile(r"^(0|[1-9][0-9]{0,9})/([a-z0-9][a-z0-9._-]{0,62})$")
"""``UID/NAME``: the snapshot named NAME of user UID."""


def snapshot_name(name: str) -> str:
    """Return ``name`` if valid (``[a-z0-9][a-z0-9._-]{0,62}``, not a snapshot id); raise otherwise.

    Raises:
        InvalidArgumentError: reason ``INVALID_NAME``.
    """
    if not NAME_RE.fullmatch(name) or SNAPSHOT_ID_RE.fullmatch(name):
        raise InvalidArgumentError(
            f"invalid snapshot name {_shown(name)}: use 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit (and not of the form snap-…)",
            reason="INVALID_NAME",
            metadata={"name": name[:100]},
        )
    return name


def snapshot_ref(ref: str) -> str:
    """Return ``ref`` if it can name a snapshot: an id (global), a name (the caller's own snapshot of that
    name: names are per owner) or ``UID/NAME`` (user UID's snapshot NAME; for root, or UID itself).

    Raises:
        InvalidArgumentError: reason ``INVALID_SNAPSHOT_REF``.
    """
    if SNAPSHOT_ID_RE.fullmatch(ref) or NAME_RE.fullmatch(ref) or OWNED_REF_RE.fullmatch(ref):
        return ref
    raise InvalidArgumentError(
        f"{_shown(ref)} is neither a snapshot id (snap-…), a snapshot name nor UID/NAME; list snapshots with `gpusnap ls`",
        reason="INVALID_SNAPSHOT_REF",
        metadata={"snapshot": ref[:100]},
    )


def split_snapshot_ref(ref: str, owner_uid: int) -> tuple[int, str]:
    """``(uid, name)`` of a name reference: ``UID/NAME``, or ``NAME`` of ``owner_uid``."""
    m = OWNED_REF_RE.fullmatch(ref)
    return (int(m.group(1)), m.group(2)) if m else (owner_uid, ref)


def operation_id(op_id: str) -> str:
    """Return ``op_id`` if well formed (``op-`` + 26 base32 characters).

    Raises:
        InvalidArgumentError: reason ``INVALID_OPERATION_ID``.
    """
    if not OPERATION_ID_RE.fullmatch(op_id):
        raise InvalidArgumentError(
            f"invalid operation id {_shown(op_id)}: an operation id is op- and 26 characters a-z and 2-7 "
            "(op-a4xk…), as `dump --detach`, `restore --detach` and `gpusnap ops` print it",
            reason="INVALID_OPERATION_ID",
        )
    return op_id


def standby_id(value: str) -> str:
    """A standby id (``sb-`` + 26 base32 characters).

    Raises:
        InvalidArgumentError: reason ``INVALID_STANDBY_ID``.
    """
    if not STANDBY_ID_RE.fullmatch(value):
        raise InvalidArgumentError(
            f"{_shown(value)} is not a standby id (sb- and 26 characters; `gpusnap standbys` lists them)",
            reason="INVALID_STANDBY_ID",
        )
    return value


def labels(value: Mapping[str, str]) -> dict[str, str]:
    """Return a copy of ``value`` if every key and value is acceptable.

    Raises:
        InvalidArgumentError: reason ``INVALID_LABEL``.
    """
    if len(value) > MAX_LABELS:
        raise InvalidArgumentError(f"too many labels ({len(value)} > {MAX_LABELS})", reason="INVALID_LABEL")
    for key, val in value.items():
        if key.startswith(RESERVED_LABEL_PREFIX):
            raise InvalidArgumentError(
                f"label key {_shown(key)} uses the prefix {RESERVED_LABEL_PREFIX!r}, which gpusnap reserves for itself",
                reason="INVALID_LABEL",
            )
        if not LABEL_KEY_RE.fullmatch(key):
            raise InvalidArgumentError(
                f"invalid label key {_shown(key)}: 1-128 characters of letters, digits, '.', '_', '/', '-'",
                reason="INVALID_LABEL",
            )
        if len(val) > MAX_LABEL_VALUE or not val.replace(" ", "").isprintable():  # no C0/C1 controls, DEL, bidi
            raise InvalidArgumentError(
                f"invalid value for label {_shown(key)}: at most {MAX_LABEL_VALUE} printable characters",
                reason="INVALID_LABEL",
            )
    return dict(value)


def label_selector(value: Mapping[str, str]) -> dict[str, str]:
    """Return a copy of ``value``, a label selector (``ListSnapshots``), if it is one a label set could match:
    at most ``MAX_LABELS`` pairs of keys and values within the labels' sizes (gpusnap's own keys allowed).
    A 10,000-pair selector was accepted, and matched against every snapshot (issue 26, item 9).

    Raises:
        InvalidArgumentError: reason ``INVALID_LABEL``.
    """
    if len(value) > MAX_LABELS:
        raise InvalidArgumentError(
            f"a label selector of {len(value)} pairs can match no snapshot: labels have at most {MAX_LABELS}",
            reason="INVALID_LABEL",
        )
    labels({k.removeprefix(RESERVED_LABEL_PREFIX) or k: v for k, v in value.items()})
    return dict(value)


def restore_context(env: Mapping[str, str], unset_env: Sequence[str], values: Mapping[str, str]) -> None:
    """Check a restore context before anything is restored (the worker applies it only at resume, after
    CRIU and the GPU restore, where a name ``os.environ`` refuses would fail the whole restore).

    Environment names are POSIX portable names (``[A-Za-z_][A-Za-z0-9_]*``, at most 128 characters); value
    keys are 1-128 characters of letters, digits, ``.``, ``_``, ``/``, ``-``; no value holds a NUL byte or is
    over 32 KiB; at most 256 entries and 256 KiB in all.

    Raises:
        InvalidArgumentError: reason ``INVALID_RESTORE_CONTEXT``, naming the first bad entry.
    """

    def bad(what: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"invalid restore context: {what}", reason="INVALID_RESTORE_CONTEXT")

    if len(env) + len(unset_env) + len(values) > MAX_CONTEXT_ENTRIES:
        raise bad(f"more than {MAX_CONTEXT_ENTRIES} entries")
    for name in [*env, *unset_env]:
        if not ENV_NAME_RE.fullmatch(name):
            raise bad(f"environment variable name {_shown(name)}: letters, digits and '_', not starting with a digit")
    for key in values:
        if not CONTEXT_KEY_RE.fullmatch(key):
            raise bad(f"value key {_shown(key)}: 1-128 characters of letters, digits, '.', '_', '/', '-'")
    total = 0
    for key, val in [*env.items(), *values.items()]:
        total += len(key) + len(val.encode())
        if "\0" in val or len(val.encode()) > MAX_CONTEXT_VALUE:
            raise bad(f"the value of {_shown(key)}: at most {MAX_CONTEXT_VALUE // 1024} KiB, with no NUL byte")
    if total > MAX_CONTEXT_BYTES:
        raise bad(f"{total} bytes in all (at most {MAX_CONTEXT_BYTES // 1024} KiB)")


def pid(value: int) -> int:
    """Return ``value`` if it can be a PID (2 … 2**22).

    Raises:
        InvalidArgumentError: reason ``INVALID_PID``.
    """
    if value == 1:
        raise InvalidArgumentError(
            "PID 1 is the init process of this PID namespace and cannot be checkpointed; "
            "name the root of the worker's process tree instead",
            reason="INVALID_PID",
            metadata={"pid": "1"},
        )
    if not 1 < value <= 4194304:
        raise InvalidArgumentError(f"{value} is not a valid PID", reason="INVALID_PID", metadata={"pid": str(value)})
    return value


REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def request_id(value: str) -> str:
    """An idempotency key: 1-128 characters of ``[A-Za-z0-9._:-]`` (a UUID fits).

    Raises:
        InvalidArgumentError: reason ``INVALID_REQUEST_ID`` (the value itself is not echoed).
    """
    if not REQUEST_ID_RE.fullmatch(value):
        raise InvalidArgumentError(
            "request_id must be 1-128 characters of letters, digits, '.', '_', ':' or '-' (a UUID, say)",
            reason="INVALID_REQUEST_ID",
        )
    return value
