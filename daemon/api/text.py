"""Text for people, shortened where it must be: never in the middle of a word."""

from __future__ import annotations

ELLIPSIS = "…"


def cut(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else as much of it as fits before its last space (a
    word, a path and a number stay whole), and "…": at most ``limit`` characters in all. A text with no space
    in that room (one long word) is cut where it must be."""
    if len(text) <= limit:
        return text
    room = text[: max(limit - len(ELLIPSIS), 0)]
    space = room.rstrip().rfind(" ")
    return (room[:space].rstrip(" |,;:") if space > 0 else room) + ELLIPSIS
