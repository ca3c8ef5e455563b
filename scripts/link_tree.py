"""Make DIR a link tree of this checkout: ``DIR/gpusnap/daemon`` and ``DIR/gpusnap/adapters`` link to the
checkout's ``daemon/`` and ``adapters/``, and ``DIR/gpusnap-<version>.dist-info`` carries the package's
``gpusnap.engines`` entry points (``adapters/contract/registry.py`` finds the engines through them).

The one way this checkout is used without being installed: ``PYTHONPATH=DIR`` on the GPU machines (``make
test-gpu``, the GPU benches: ``build/pkg``), mypy (``make typecheck``: ``.mypy_src``), and the workers the tests
run in the vLLM-on-CPU venv. It carries no other entry points: an engine on that path loads no gpusnap plugin
unless gpusnap is installed in its site, as an engine does with gpusnap installed.

    python scripts/link_tree.py DIR
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GROUP = "gpusnap.engines"


def make(root: Path) -> Path:
    """(Re)make the link tree under ``root``; returns ``root``. Idempotent."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    package = root / "gpusnap"
    package.mkdir(parents=True, exist_ok=True)
    for portion in ("daemon", "adapters"):
        link = package / portion
        if not link.is_symlink() or link.resolve() != REPO / portion:
            link.unlink(missing_ok=True)
            link.symlink_to(REPO / portion)
    for stale in root.glob("gpusnap-*.dist-info"):
        shutil.rmtree(stale)
    info = root / f"gpusnap-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: gpusnap\nVersion: {project['version']}\n")
    points = project["entry-points"][GROUP]
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    make(Path(sys.argv[1]))
