"""One codec for the documents gpusnapd saves: a snapshot's manifest, the operation journal's entries, the park
policies, the standbys, the park ladder's tracked trees, a snapshot's remote record and its provenance (what
the compatibility gate compares).

Each document is a frozen dataclass with a field ``schema_version`` (its default is the version this release
writes; the manifest keeps the ``manifest_version`` it had before, which other nodes read:
``gpusnap.daemon.store.manifest``); :func:`encode` and :func:`decode` turn any of them into JSON and back through one library,
msgspec, which checks every field's type on the way in, so a document is read as its type or not at all. A
document that a newer gpusnapd wrote (a higher ``schema_version``) is refused, naming the file. One written
by the release before versions (the same fields, without ``schema_version``) is read as version 1; a
document that release wrote in another shape is read through its ``previous`` type (:func:`load`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec

from gpusnap.daemon.store.durable import write_file

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Listing(Generic[T]):
    """A document that is a list of items: the park policies' rules, the standbys, the ladder's tracked trees
    (:func:`load_items`, :func:`save_items`)."""

    schema_version: int = 1
    items: tuple[T, ...] = ()


class DocumentError(ValueError):
    """A saved document that does not decode as its type (the message names the field), or that a newer
    gpusnapd wrote."""


def encode(doc: object, indent: int = 0) -> bytes:
    """``doc`` (a document dataclass) as JSON, keys sorted (``indent``: spaces per level, for a document people
    read: a snapshot's manifest)."""
    data = msgspec.json.encode(doc, order="sorted")
    return msgspec.json.format(data, indent=indent) if indent else data


def decode(data: bytes, into: type[T], previous: tuple[Any, Callable[[Any], T]] | None = None) -> T:
    """The document of type ``into`` in ``data``.

    Args:
        previous: ``(its type, what turns it into ``into``)`` for the shape the previous release wrote.

    Raises:
        DocumentError: malformed JSON, a field of the wrong type or missing, or a newer ``schema_version``.
    """
    try:
        if previous is None:
            doc = msgspec.json.decode(data, type=into)
        else:
            found = msgspec.json.decode(data, type=into | previous[0])
            doc = found if isinstance(found, typing.get_origin(into) or into) else previous[1](found)
    except msgspec.MsgspecError as exc:
        raise DocumentError(str(exc)) from exc
    return _readable(doc, into)


def _readable(doc: T, into: Any) -> T:
    """``doc``, unless a newer gpusnapd wrote it (its ``schema_version`` is above this release's).

    Raises:
        DocumentError: a newer ``schema_version``.
    """
    version = getattr(doc, "schema_version", None)
    if version is None:  # a document versioned by a field of its own (a manifest's ``manifest_version``)
        return doc
    kind: Any = typing.get_origin(into) or into
    written = kind.__dataclass_fields__["schema_version"].default
    if version > written:
        raise DocumentError(f"schema_version {version} is newer than this gpusnapd reads ({written}): upgrade gpusnapd")
    return doc


def to_builtins(doc: object) -> Any:
    """``doc`` as JSON's types, for a document carried inside another (a remote manifest's provenance)."""
    return msgspec.to_builtins(doc, order="sorted")


def convert(obj: Any, into: type[T]) -> T:
    """The document of type ``into`` that :func:`to_builtins` gave ``obj`` (a document carried inside another:
    a remote manifest's provenance, a journal entry's facts).

    Raises:
        DocumentError: a field of the wrong type or missing, or a newer ``schema_version``.
    """
    try:
        return _readable(msgspec.convert(obj, type=into), into)
    except msgspec.MsgspecError as exc:
        raise DocumentError(str(exc)) from exc


def load(path: Path, into: type[T], previous: tuple[Any, Callable[[Any], T]] | None = None) -> T:
    """:func:`decode` the document saved at ``path``.

    Raises:
        FileNotFoundError: there is none.
        OSError: it cannot be read.
        DocumentError: as :func:`decode`, naming ``path``.
    """
    data = path.read_bytes()
    try:
        return decode(data, into, previous)
    except DocumentError as exc:
        raise DocumentError(f"{path}: {exc}") from exc


def save(path: Path, doc: object) -> None:
    """Replace ``path`` with ``doc``, durably and atomically (``durable.write_file``)."""
    write_file(path, encode(doc))


def load_items(path: Path, item: type[T]) -> tuple[T, ...]:
    """The items of the :class:`Listing` saved at ``path`` (the previous release saved the bare list).

    Raises:
        As :func:`load`.
    """
    listing: Listing[T] = load(path, Listing[item], previous=(list[item], _listing))  # type: ignore[valid-type]
    return listing.items


def save_items(path: Path, items: Iterable[T]) -> None:
    """Save ``items`` as a :class:`Listing` at ``path`` (:func:`save`)."""
    save(path, Listing(items=tuple(items)))


def _listing(items: list[Any]) -> Listing[Any]:
    return Listing(items=tuple(items))
