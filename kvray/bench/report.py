"""Shared output of the benchmarks: a compact table on stdout, JSON with a top-level
`summary`, and a PNG bar chart next to the JSON."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def default_dtype(device: str = "auto") -> str:
    """The benches' dtype unless told, for `device` (auto, cpu or cuda): what `dtype="auto"`
    serves a float32 checkpoint in there, bfloat16 on a GPU or a CPU with fast bfloat16
    matmuls, else float32 (on an AVX2-only CPU bfloat16 runs on a reference path several
    times slower)."""
    import torch

    from kvray.cluster.spec import resolve_device, resolve_dtype

    return resolve_dtype("auto", torch.float32, resolve_device(device))


DTYPE_HELP = "default: bfloat16 on a GPU or a CPU with fast bfloat16, else float32"


def round_order(engines: Sequence[str], k: int) -> list[str]:
    """Round k's order of running the engines: as given, reversed every other round, so
    that a machine slowing down (or speeding up) during a run weighs on each alike."""
    return list(engines) if k % 2 == 0 else list(reversed(engines))


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(title)
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))


def write_json(path: str | None, summary: dict[str, Any], **sections: Any) -> Path | None:
    if not path:
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, **sections}, indent=2, default=str))
    return out


def write_bars(
    json_path: Path | None,
    title: str,
    groups: dict[str, dict[str, float]],
    ylabel: str,
) -> Path | None:
    """One bar chart: for each metric (x group), one bar per system. Saved as <json>.png."""
    if json_path is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(groups)
    systems = sorted({s for g in groups.values() for s in g})
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        values = [groups[metric].get(s, 0.0) for s in systems]
        bars = ax.bar(
            range(len(systems)),
            values,
            width=0.6,
            color=["#2a6f97", "#c44536", "#7a9e7e", "#e0a458"][: len(systems)],
        )
        ax.set_xticks(range(len(systems)), systems)
        ax.set_title(metric, fontsize=10)
        ax.set_ylabel(ylabel if ax is axes[0][0] else "")
        for b, v in zip(bars, values, strict=True):
            ax.annotate(
                f"{v:.3g}",
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    fig.suptitle(title)
    fig.tight_layout()
    png = json_path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
