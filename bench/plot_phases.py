"""Draw docs/performance-phases.png: phase durations, stock versus gpusnap, from bench/results JSON.

    python bench/plot_phases.py [--out docs/performance-phases.png]    (make perf-chart; needs matplotlib)

Each bar stacks the phases of one operation in the order they ran; the number at its end is the sum, then
the results file it comes from. Rows: stock (CRIU and the CUDA checkpoint alone, or plain CRIU), gpusnap
as the last turn left it (the files named below), and gpusnap now (the newest committed file).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

# "Last turn": the results docs/performance.md reported before issue 12's work; "now": the newest committed
# file of each benchmark, so a new run is drawn once its JSON is committed.
ENGINE_LAST = "gpu-engine-h200-final-8b-20261129T223031.json"
GPU_LAST = "gpu-h200-offload-ramstore-20261129T222235.json"
OVERHEAD_START = "overhead-before-20261201T124030.json"
OVERHEAD_LAST = "overhead-after-20261201T134043.json"
OVERHEAD_NOW = ("overhead-ab-20261201T195631.json", "helper_only_gpusnap")
"""The A/B run of the third pass and its daemon running the code kept (its ``gpusnap`` daemon ran changes
that were dropped; docs/performance.md); its ``baseline_gpusnap`` is the second pass's code."""


def newest(pattern: str) -> str:
    """The newest committed results file matching ``pattern`` (by the UTC date its name ends in)."""
    names = sorted((p.name for p in RESULTS.glob(pattern)), key=lambda n: n.removesuffix(".json")[-15:])
    if not names:
        raise SystemExit(f"no bench/results/{pattern}")
    return names[-1]


def _overhead(key: str, kind: str, prefix: str = "gpusnap") -> Any:
    """A gpusnap operation of an overhead run as phases, plus the time outside them ("other"); ``prefix``
    ``baseline_gpusnap``: the run's baseline daemon (``--baseline``)."""

    def pick(d: dict[str, Any]) -> dict[str, float]:
        w = d["workloads"][kind]
        medians = w[f"{prefix}_{key}_phases_median_s"]  # by name: put back in the order they ran
        phases = {n: medians[n] for n in sorted(medians, key=lambda n: RUN_ORDER.index(n) if n in RUN_ORDER else 99)}
        phases["other"] = max(0.0, w[f"{prefix}_{key}"]["median_s"] - sum(phases.values()))
        return phases

    return pick


RUN_ORDER = ["preflight", "verify", "dump", "restore", "checksum", "publish", "finish", "validate"]


def _criu(action: str, kind: str) -> Any:
    return lambda d: {"criu": d["workloads"][kind][f"criu_{action}"]["median_s"]}


def panels() -> list[tuple[str, list[tuple[str, str, Any]]]]:
    engine_now = newest("gpu-engine-h200-graphs-8b-2*.json")
    gpu_now = newest("gpu-h200-16g-2*.json")
    prefill_now = newest("gpu-prefill-2*.json")  # make bench-gpu --modes stable,prefill
    overhead_now, now_prefix = OVERHEAD_NOW  # an A/B run (--baseline): the last turn's code beside now
    out: list[tuple[str, list[tuple[str, str, Any]]]] = []
    for op in ("restore", "checkpoint"):
        out.append(
            (
                f"8B Llama-style worker: {op} (s)",
                [
                    ("stock", engine_now, lambda d, op=op: d["stock"][f"{op}_phases"]),
                    ("gpusnap, last turn", ENGINE_LAST, lambda d, op=op: d[f"{op}_phases"]),
                    ("gpusnap, now", engine_now, lambda d, op=op: d[f"{op}_phases"]),
                ],
            )
        )
    for op in ("restore", "checkpoint"):
        out.append(
            (
                f"16 GiB of GPU data: {op} (s)",
                [
                    ("stock, disk store", gpu_now, lambda d, op=op: _mode(d, "stock")[op]["phases"]),
                    ("gpusnap, last turn", GPU_LAST, lambda d, op=op: _mode(d, "offload")[op]["phases"]),
                    ("gpusnap, now", gpu_now, lambda d, op=op: _mode(d, "offload")[op]["phases"]),
                    ("gpusnap, now, arena", prefill_now, lambda d, op=op: _mode(d, "stable")[op]["phases"]),
                    *(
                        [
                            (
                                "gpusnap, now, prefill (warm)",
                                prefill_now,
                                lambda d: _mode(d, "prefill")["restore_again"]["phases"],
                            )
                        ]
                        if op == "restore"
                        else []
                    ),
                ],
            )
        )
    for action, key in (("dump", "dump"), ("restore", "restore_host_pidns")):
        out.append(
            (
                f"CPU tree (python parent + child, 4 MiB), median {action} (s), make bench-overhead",
                [
                    ("plain CRIU", overhead_now, _criu(action, "tree")),
                    ("gpusnap, before issue 12", OVERHEAD_START, _overhead(key, "tree")),
                    ("gpusnap, last turn", OVERHEAD_LAST, _overhead(key, "tree")),
                    ("gpusnap, last turn, A/B run", overhead_now, _overhead(key, "tree", "baseline_gpusnap")),
                    ("gpusnap, now, A/B run", overhead_now, _overhead(key, "tree", now_prefix)),
                ],
            )
        )
    return out


SHOWN = [
    "criu",
    "preflight",
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
"""Phases with a colour of their own (``criu``: plain CRIU's whole run); the rest are drawn as "other"."""


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
    shown = panels()
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 1.9 * len(shown) + 1.2))
    for ax, (title, bars) in zip(axes, shown, strict=True):
        for row, (_label, name, pick) in enumerate(bars):
            phases: dict[str, float] = pick(json.loads((RESULTS / name).read_text()))
            left = 0.0
            for phase, seconds in phases.items():
                key = phase if phase in SHOWN else "other"
                ax.barh(row, seconds, left=left, color=colours[key], edgecolor="white", linewidth=0.5)
                left += seconds
            ax.text(left, row, f" {left:.2f} s  ({name.removesuffix('.json')})", va="center", fontsize=7)
        ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=9)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlim(0, ax.get_xlim()[1] * 1.45)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in SHOWN + ["other"]]
    fig.legend(handles, SHOWN + ["other"], loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.suptitle(
        "gpusnap phase durations: one H200 (driver 580, CRIU 4.2.1); CPU rows: a loaded 2-vCPU CI host", fontsize=11
    )
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
