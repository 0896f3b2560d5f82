"""The bench's pictures (``--charts DIR``): PNG files drawn with matplotlib.

* ``incident.png``: an incident's closings and its events on Kafka over time,
  cumulative counts against seconds from the first closing (bench/incident.py).
* ``sustained.png``: the relay's rate for each incident of the sustained run,
  one bar each, the incidents under a held snapshot marked (bench/sustained.py).

Drawn off screen (the Agg backend): the bench runs where no display is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display here

import matplotlib.pyplot as plt

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _cumulative(times: Sequence[float], start: float) -> tuple[list[float], list[int]]:
    """Seconds from ``start`` and how many happened by then, as a step line."""
    xs = [t - start for t in sorted(times)]
    return xs, list(range(1, len(xs) + 1))


def incident_chart(
    path: Path, closings: Sequence[float], on_kafka: Sequence[float], title: str
) -> Path:
    """Cumulative closings and events on Kafka (epoch seconds each) against seconds
    from the first closing."""
    start = min(closings)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        xs, ys = _cumulative(closings, start)
        ax.step(xs, ys, where="post", label="rooms closed")
        xs, ys = _cumulative(on_kafka, start)
        ax.step(xs, ys, where="post", label="events on Kafka")
        ax.set_xlabel("seconds from the first closing")
        ax.set_ylabel("cumulative count")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def sustained_chart(
    path: Path,
    rates: Sequence[float],
    held: Sequence[bool],
    title: str,
    floors: Sequence[float] = (0.9, 0.7),
    baseline: Sequence[float] = (),
) -> Path:
    """One bar per incident (events/s); incidents under a held snapshot hatched, the
    goals as dashed lines: each of ``floors`` times the first incident's rate;
    ``baseline`` (0.3.0's marking relay on the same incidents), when given, as marks."""
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        labels = [str(n) for n in range(1, len(rates) + 1)]
        bars = ax.bar(labels, rates, color=["tab:orange" if h else "tab:blue" for h in held])
        for bar, h in zip(bars, held, strict=True):
            if h:
                bar.set_hatch("//")
        for floor, style in zip(floors if rates else (), ("--", ":"), strict=False):
            ax.axhline(
                rates[0] * floor,
                color="grey",
                linestyle=style,
                linewidth=1,
                label=f"{floor:g}x the first incident's rate",
            )
        if baseline:
            ax.plot(
                labels,
                baseline,
                linestyle="none",
                marker="D",
                color="black",
                label="0.3.0's marking relay, same incidents (baseline)",
            )
        if rates:
            # room above the bars for the legend
            ax.set_ylim(0, max([*rates, *baseline]) * 1.3)
            ax.legend(loc="upper center", ncol=2, fontsize=8, framealpha=0.9)
        ax.set_xlabel("incident (hatched: another session holds a REPEATABLE READ snapshot)")
        ax.set_ylabel("relay, events/s")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def is_png(path: Path) -> bool:
    """Whether ``path`` is a non-empty file that starts as a PNG does."""
    data = path.read_bytes()
    return len(data) > len(PNG_SIGNATURE) and data.startswith(PNG_SIGNATURE)
