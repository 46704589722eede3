"""gkamradt-style heatmap: needle depth (rows) x length (columns: context tokens, or images / frames
per prompt for multimodal needles), red -> green accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# gkamradt's colours, red (0%) -> yellow -> green (100%)
_COLOURS = ["#F0496E", "#EBB839", "#0CD79F"]
AXIS_LABELS = {"tokens": "context length (tokens)", "images": "images per prompt", "frames": "frames per video"}


def length_label(length: int) -> str:
    for suffix, size in (("m", 1 << 20), ("k", 1 << 10)):
        if length >= size and length % size == 0:
            return f"{length // size}{suffix}"
    return str(length)


def length_axis_label(summary: dict[str, Any]) -> str:
    """What a length counts: the tasks' common unit, or every unit when they differ."""
    units = sorted({task["unit"] for task in summary["tasks"].values()})
    if len(units) == 1:
        return AXIS_LABELS.get(units[0], units[0])
    return "length (" + " / ".join(units) + ")"


def title(summary: dict[str, Any]) -> str:
    """What the heatmap shows: the tasks, the model (the target: a served name and its server, or
    engine:<checkpoint>), the samples each cell averages, and the overall accuracy."""
    config = summary["config"]
    samples = config.get("samples", 1)
    accuracy = "-" if summary["accuracy"] is None else f"{100 * summary['accuracy']:.1f}%"
    return (f"{', '.join(summary['tasks']) or 'no task'} on {config.get('target', 'an unnamed target')}\n"
            f"{samples} sample{'' if samples == 1 else 's'} per cell, {accuracy} overall")


def plot(summary: dict[str, Any], path: str | Path) -> None:
    """Write the grid of `summary` (per length x depth; by length alone when depths are random)."""
    # imported here: matplotlib is slow to import and only the report needs it
    # lazy: matplotlib (the eval extra) only when a heatmap is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.figure import Figure

    lengths, depths = summary["lengths"], summary["depths"]
    if depths:
        rows = [f"{d:g}%" for d in depths]
        values = np.array([[np.nan if v is None else v for v in column] for column in summary["grid"]], float).T
    else:
        rows = ["random"]
        by_length = summary["by_length"]
        values = np.array([[np.nan if by_length.get(str(n)) is None else by_length[str(n)] for n in lengths]], float)
    fig = Figure(figsize=(max(4.0, 1.0 + 0.9 * len(lengths)), max(2.5, 1.2 + 0.45 * len(rows))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = LinearSegmentedColormap.from_list("niah", _COLOURS)
    image = ax.imshow(100 * values, cmap=cmap, vmin=0, vmax=100, aspect="auto")
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            if not np.isnan(values[i, j]):
                ax.text(j, i, f"{100 * values[i, j]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(length_axis_label(summary))
    ax.set_ylabel("needle depth")
    ax.set_title(title(summary), fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    fig.tight_layout()
    fig.savefig(path)
