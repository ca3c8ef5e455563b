"""Draw docs/performance-phases.png: phase durations, stock versus gpusnap, from bench/results JSON.

    python bench/plot_phases.py [--out docs/performance-phases.png]    (make perf-chart; needs matplotlib)

Each bar stacks the phases of one operation in the order they ran; the number at its end is the sum.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

ENGINE_THP = "gpu-engine-h200-final-thp-8b-20261129T222913.json"
ENGINE = "gpu-engine-h200-final-8b-20261129T223031.json"
GPU_STOCK = "gpu-h200-offload-20261129T220235.json"
GPU_RAM = "gpu-h200-offload-ramstore-20261129T222235.json"
GPU_RAM_THP = "gpu-h200-offload-ramstore-thp-20261129T222254.json"

PANELS: list[tuple[str, list[tuple[str, str, Any]]]] = [
    (
        "8B Llama-style worker: restore (s)",
        [
            ("stock, THP always", ENGINE_THP, lambda d: d["stock"]["restore_phases"]),
            ("gpusnap, THP madvise", ENGINE, lambda d: d["restore_phases"]),
            ("gpusnap, THP always", ENGINE_THP, lambda d: d["restore_phases"]),
        ],
    ),
    (
        "8B Llama-style worker: checkpoint (s)",
        [
            ("stock, THP always", ENGINE_THP, lambda d: d["stock"]["checkpoint_phases"]),
            ("gpusnap, THP always", ENGINE_THP, lambda d: d["checkpoint_phases"]),
        ],
    ),
    (
        "16 GiB of GPU data: restore (s)",
        [
            ("stock, disk store", GPU_STOCK, lambda d: _mode(d, "stock")["restore"]["phases"]),
            ("gpusnap, RAM store", GPU_RAM, lambda d: _mode(d, "offload")["restore"]["phases"]),
            ("gpusnap, RAM store, THP", GPU_RAM_THP, lambda d: _mode(d, "offload")["restore"]["phases"]),
        ],
    ),
    (
        "16 GiB of GPU data: checkpoint (s)",
        [
            ("stock, disk store", GPU_STOCK, lambda d: _mode(d, "stock")["checkpoint"]["phases"]),
            ("gpusnap, RAM store", GPU_RAM, lambda d: _mode(d, "offload")["checkpoint"]["phases"]),
            ("gpusnap, RAM store, THP", GPU_RAM_THP, lambda d: _mode(d, "offload")["checkpoint"]["phases"]),
        ],
    ),
]

SHOWN = [
    "warm-up",
    "offload",
    "gpu-checkpoint",
    "dump",
    "checksum",
    "publish",
    "verify",
    "restore",
    "gpu-restore",
    "reload-buffers",
    "resume-worker",
]
"""Phases with a colour of their own; the rest (each well under 0.1 s) are drawn as "other"."""


def _mode(doc: dict[str, Any], mode: str) -> dict[str, Any]:
    return next(r for r in doc["runs"] if r.get("mode", "stock") == mode)


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(REPO / "docs" / "performance-phases.png"))
    args = ap.parse_args()
    colours = dict(zip(SHOWN + ["other"], plt.get_cmap("tab20").colors, strict=False))
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(11, 2.1 * len(PANELS) + 1.2))
    for ax, (title, bars) in zip(axes, PANELS, strict=True):
        for row, (_label, name, pick) in enumerate(bars):
            phases: dict[str, float] = pick(json.loads((RESULTS / name).read_text()))
            left = 0.0
            for phase, seconds in phases.items():
                key = phase if phase in SHOWN else "other"
                ax.barh(row, seconds, left=left, color=colours[key], edgecolor="white", linewidth=0.5)
                left += seconds
            ax.text(left, row, f" {left:.2f} s", va="center", fontsize=9)
        ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=9)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlim(0, ax.get_xlim()[1] * 1.08)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in SHOWN + ["other"]]
    fig.legend(handles, SHOWN + ["other"], loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.suptitle("gpusnap phase durations on one H200 (driver 580, CRIU 4.2.1)", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
