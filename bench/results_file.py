"""One way for every benchmark to write its results: ``<out>/<benchmark>[-<label>]-<UTC date>.json``.

Each document gets ``benchmark`` and ``date`` (ISO 8601, UTC, seconds) if it lacks them, and the host's
kernel and CPU count under ``host`` beside what the benchmark put there; the file is indented JSON ending
in a newline, so diffs of committed results stay readable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--out`` (directory, default bench/results) and ``--label`` (a tag in the file name)."""
    ap.add_argument("--out", default=str(RESULTS), help="directory for the results JSON")
    ap.add_argument("--label", default="", help="tag for the results file name")


def write(doc: dict[str, Any], benchmark: str, out: str | Path = RESULTS, label: str = "") -> Path:
    """Write ``doc`` as ``<out>/<benchmark>[-<label>]-<YYYYmmddTHHMMSS>.json`` and print its path.

    Returns:
        The file written.

    Raises:
        OSError: ``out`` cannot be created or written.
    """
    now = datetime.now(UTC)
    doc.setdefault("benchmark", benchmark)
    doc.setdefault("date", now.isoformat(timespec="seconds"))
    host = doc.setdefault("host", {})
    host.setdefault("kernel", platform.release())
    host.setdefault("cpus", os.cpu_count())
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{benchmark}-{label + '-' if label else ''}{now:%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
    return path
