"""PNG figures of benchmark results: matplotlib, headless, loaded only when a figure is drawn.

matplotlib is a development dependency: without it `pyplot()` says so and returns None, and the
benchmark keeps its JSON results. `save_figure` writes a figure where the caller says (the scripts
name their files with `benchmarks.common.result_path`) and closes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

console = Console()


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        console.print("[yellow]matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"[green]wrote {path}")
    return path


def timelines(path: Path, arms: dict[str, dict[str, Any]], title: str) -> None:
    """Cumulative generated tokens over time, one line per arm, with throughput in the legend."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, arm in arms.items():
        seconds, tokens = zip(*arm["timeline"], strict=True)
        ax.plot(seconds, tokens, label=f"{label}: {arm['tokens_per_second']:.1f} tok/s")
    ax.set(xlabel="seconds", ylabel="generated tokens", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def bars(path: Path, values: dict[str, float], ylabel: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = ax.bar(list(values), list(values.values()), color="tab:blue")
    ax.bar_label(drawn, fmt="%.1f")
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def stacked(path: Path, columns: dict[str, dict[str, float]], ylabel: str, title: str,
            reference: dict[str, float] | None = None) -> None:
    """One stacked bar per column (parts in ms); `reference` draws a marker per column (e.g. 2x linear)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = list(columns)
    parts = list(next(iter(columns.values())))
    bottoms = [0.0] * len(labels)
    for part in parts:
        heights = [columns[label][part] for label in labels]
        ax.bar(labels, heights, bottom=bottoms, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    if reference:
        for index, label in enumerate(labels):
            if label in reference:
                ax.hlines(reference[label], index - 0.4, index + 0.4, colors="black", linestyles="dashed")
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    save_figure(fig, path)
