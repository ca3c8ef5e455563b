"""Pagination of List calls (Google AIP-158: ``page_size``, ``page_token``, ``next_page_token``).

Lists are ordered by (creation time, id). A page token names the last item of the page before it, as
``<creation time in ns>.<id>`` in URL-safe base64, so a page boundary survives items being added or
deleted between calls. An empty ``next_page_token`` means the list is complete.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

from gpusnap.daemon.api.errors import InvalidArgumentError

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
"""Larger requests are served this many items (AIP-158 coerces, it does not refuse)."""
MAX_PAGE_BYTES = 2 * 1024 * 1024
"""Encoded items per response: half of gRPC's default 4 MiB receive limit, so a page always arrives."""
_TOKEN_RE = re.compile(r"^(\d{1,20})\.([a-z]{1,8}-[a-z2-7]{26})$")

Key = tuple[int, str]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclasses.dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list; ``next_token`` is empty on the last page."""

    items: list[T]
    next_token: str


def page_size(requested: int) -> int:
    """The number of items to serve for a request's ``page_size`` (0: the default).

    Raises:
        InvalidArgumentError: a negative size (reason ``INVALID_PAGE_SIZE``).
    """
    if requested < 0:
        raise InvalidArgumentError(f"page_size must not be negative (got {requested})", reason="INVALID_PAGE_SIZE")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def key(created: datetime, item_id: str) -> Key:
    """The sort key of an item: (creation time in ns since the epoch, id)."""
    return ((created - _EPOCH) // timedelta(microseconds=1) * 1000, item_id)


def token(k: Key) -> str:
    """The page token that continues after the item with key ``k``."""
    return base64.urlsafe_b64encode(f"{k[0]}.{k[1]}".encode()).decode().rstrip("=")


def parse_token(value: str) -> Key | None:
    """The key a page token continues after; ``None`` for the empty token (the first page).

    Raises:
        InvalidArgumentError: not a token this daemon issued (reason ``INVALID_PAGE_TOKEN``).
    """
    if not value:
        return None
    bad = InvalidArgumentError(
        "page_token is not one this daemon issued; pass the next_page_token of the previous page, or none for "
        "the first page",
        reason="INVALID_PAGE_TOKEN",
    )
    if len(value) > 128:
        raise bad
    try:
        text = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise bad from None
    match = _TOKEN_RE.fullmatch(text)
    if not match:
        raise bad
    return (int(match.group(1)), match.group(2))


def paginate(items: Sequence[T], key_of: Callable[[T], Key], size: int, page_token: str) -> Page[T]:
    """The page of ``items`` (sorted by ``key_of``) that follows ``page_token``, at most ``size`` long.

    Raises:
        InvalidArgumentError: see :func:`parse_token`.
    """
    after = parse_token(page_token)
    rest = [i for i in items if after is None or key_of(i) > after]
    chosen = rest[:size]
    return Page(chosen, token(key_of(chosen[-1])) if len(rest) > size else "")


def fit(page: Page[T], sizes: Sequence[int], key_of: Callable[[T], Key], budget: int = MAX_PAGE_BYTES) -> Page[T]:
    """``page`` shortened to ``budget`` bytes, given the encoded size of each of its items.

    At least one item is kept (one snapshot is far below gRPC's limit), so a list always advances.
    """
    total = 0
    for n, size in enumerate(sizes):
        total += size
        if total > budget and n > 0:
            return Page(page.items[:n], token(key_of(page.items[n - 1])))
    return page
