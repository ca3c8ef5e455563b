"""Byte counts for people, one way everywhere: the CLI's tables and the daemon's messages say the same size the
same way (``3.8 MiB``, never ``4 MiB`` in one place and ``3.8 MiB`` in another)."""

from __future__ import annotations


def human_size(n: int) -> str:
    """``n`` bytes in binary units with one decimal: ``512 B``, ``3.8 MiB``, ``16.0 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)
