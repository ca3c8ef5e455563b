"""What each process of a snapshot occupies in its CRIU images: memory pages by process, and the rest.

    python bench/image_makeup.py SNAPSHOT_IMAGES_DIR [--pycriu-path PATH]

Reads ``pstree.img``, ``core-<pid>.img`` (the process's name) and ``pagemap-<pid>.img`` (its dumped pages)
with pycriu; prints one JSON line per process, ``{"pid", "comm", "page_bytes"}``, and one for the files that
are not pages (``{"other_bytes"}``). Used to state what stays in the image of an engine's processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PAGE = 4096


def makeup(images: Path) -> tuple[list[dict[str, Any]], int]:
    """Per-process page bytes, and the bytes of every image file that is not a pages file."""
    from pycriu import images as criu_images

    def load(name: str) -> list[dict[str, Any]]:
        with open(images / name, "rb") as fh:
            return list(criu_images.load(fh)["entries"])

    rows = []
    for item in load("pstree.img"):
        pid = int(item["pid"])
        comm = load(f"core-{pid}.img")[0]["tc"]["comm"]
        pages = sum(int(e.get("nr_pages", 0)) for e in load(f"pagemap-{pid}.img")[1:])
        rows.append({"pid": pid, "comm": comm, "page_bytes": pages * PAGE})
    other = sum(f.stat().st_size for f in images.rglob("*") if f.is_file() and not f.name.startswith("pages-"))
    return rows, other


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("images", type=Path)
    ap.add_argument("--pycriu-path", default="")
    args = ap.parse_args()
    if args.pycriu_path:
        sys.path.insert(0, args.pycriu_path)
    rows, other = makeup(args.images)
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({"other_bytes": other}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
