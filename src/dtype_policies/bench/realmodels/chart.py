"""The trade-off chart of a real-model table: one panel per speed workload,
time (x, log) against quality (y, log; lower is better on both), one point
per variant, coloured by family (this library's circles, the peers'
squares), with the frontier (the variants no other variant beats on both)
drawn as a dashed step. Labels are placed where they overlap no other label
or point when such a place is near (`place_labels`). Needs matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Per model: its panels (time column, axis label), then (quality column, axis label).
PANELS = {
    "smollm2": (
        (
            ("decode_ms", "ms per new token, batch-1 greedy decode"),
            ("prefill_ms", "ms per 512-token prefill"),
        ),
        ("perplexity", "perplexity on GPL-3 (8 x 512 tokens)"),
    ),
    "minilm": (
        (
            ("b1x32_ms", "ms per call, batch 1 x 32 tokens"),
            ("b32x128_ms", "ms per call, batch 32 x 128 tokens"),
        ),
        ("cosine_distance", "1 - mean cosine to float32 (200 sentences)"),
    ),
}
OURS = "dtype-policies"
COSINE_DISTANCE_FLOOR = 1e-6

Point = tuple[str, str, float, float]  # (variant, family, time, quality)


def points(table: dict, time_key: str) -> list[Point]:
    """(variant, family, time, quality) of every row with both figures."""
    quality_key = PANELS[table["model"]][1][0]
    out = []
    for row in table["rows"]:
        source = "cosine_mean" if quality_key == "cosine_distance" else quality_key
        if row.get("status") != "ok" or time_key not in row or source not in row:
            continue
        if quality_key == "cosine_distance":  # float32 itself is 0: drawn at the floor
            value = max(1 - row["cosine_mean"], COSINE_DISTANCE_FLOOR)
        else:
            value = row[quality_key]
        out.append((row["variant"], row["family"], row[time_key], value))
    return out


def frontier(found: list[Point]) -> list[Point]:
    """The points no other point beats on both time and quality (lower is better).

    >>> [p[0] for p in frontier([("a", "", 1, 5), ("b", "", 2, 3), ("c", "", 3, 4)])]
    ['a', 'b']
    """
    best, out = float("inf"), []
    for point in sorted(found, key=lambda p: (p[2], p[3])):
        if point[3] < best:
            best = point[3]
            out.append(point)
    return out


# Label offsets tried in turn (points from the marker), nearest first.
_OFFSETS = [
    (dx * r, dy * r)
    for r in (1, 2, 3.5, 5, 7)
    for dx, dy in ((5, 3), (5, -9), (-5, 3), (-5, -9), (0, 8), (0, -14), (8, -3), (-8, -3))
]


def _overlap(a: Any, b: Any) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width * height if width > 0 and height > 0 else 0.0


def place_labels(axes: Any, found: list[Point], first: set[str]) -> None:
    """Annotates every point with its variant name at the nearest offset that
    overlaps no placed label, no marker, stays inside the axes and lies nearer
    to its own point than to any other (the least bad one otherwise, with a
    leader line); `first` are placed first."""
    from matplotlib.transforms import Bbox

    figure = axes.figure
    renderer = figure.canvas.get_renderer()
    inside = axes.get_window_extent(renderer)
    centres = [tuple(axes.transData.transform((x, y))) for _, _, x, y in found]
    markers = [Bbox.from_extents(cx - 4, cy - 4, cx + 4, cy + 4) for cx, cy in centres]
    placed: list[Any] = []
    order = sorted(found, key=lambda p: (p[0] not in first, p[2]))
    for name, _, x, y in order:
        own = tuple(axes.transData.transform((x, y)))
        others = [centre for centre in centres if centre != own]
        best: tuple[float, Any, tuple[float, float], bool] | None = None
        for dx, dy in _OFFSETS:
            label = _label(axes, name, (x, y), (dx, dy))
            box = label.get_window_extent(renderer)
            cost = sum(_overlap(box, other) for other in [*placed, *markers])
            cost += 10 * (box.width * box.height - _overlap(box, inside))
            # a label nearer to another point reads as that point's name
            misleading = any(_distance(box, c) < _distance(box, own) for c in others)
            cost += 3 * box.width * box.height if misleading else 0.0
            label.remove()
            if best is None or cost < best[0]:
                best = (cost, box, (dx, dy), misleading)
            if cost == 0:
                break
        assert best is not None
        _, box, offset, misleading = best
        far = abs(offset[0]) + abs(offset[1]) > 20
        _label(axes, name, (x, y), offset, leader=far or misleading)
        placed.append(box)


def _distance(box: Any, point: tuple[float, float]) -> float:
    """From the middle of a label's box to a point (display units): a point
    under a long label's middle reads as its point, wherever the text starts."""
    dx = (box.x0 + box.x1) / 2 - point[0]
    dy = (box.y0 + box.y1) / 2 - point[1]
    return float((dx * dx + dy * dy) ** 0.5)


def _label(
    axes: Any, name: str, xy: tuple[float, float], offset: tuple[float, float], leader=False
) -> Any:
    return axes.annotate(
        name,
        xy,
        xytext=offset,
        textcoords="offset points",
        fontsize=7,
        ha="left" if offset[0] >= 0 else "right",
        va="bottom",
        arrowprops={"arrowstyle": "-", "color": "0.6", "linewidth": 0.5} if leader else None,
    )


def _plain_ticks(axis: Any, values: list[float]) -> None:
    """Plain numbers (20, 30, 50, 100) on a log axis of values above 0.1; the
    minor ticks at 2, 3 and 5 times a power of ten are labelled when the
    values span less than two decades."""
    from matplotlib.ticker import FuncFormatter

    low, high = min(values), max(values)
    if low < 0.1:
        return
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    if high / low < 100:
        axis.set_minor_formatter(
            FuncFormatter(lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "235" else "")
        )


def _panel(axes: Any, found: list[Point], colours: dict[str, Any], labels: tuple[str, str]):
    for family, colour in colours.items():
        mine = [p for p in found if p[1] == family]
        if not mine:
            continue
        axes.scatter(
            [p[2] for p in mine],
            [p[3] for p in mine],
            label=family,
            color=colour,
            marker="o" if family == OURS else "s",
            s=22,
            zorder=3,
        )
    edge = frontier(found)
    axes.step(
        [p[2] for p in edge],
        [p[3] for p in edge],
        where="post",
        color="grey",
        linestyle="--",
        linewidth=1,
        marker="o",
        markersize=11,
        markerfacecolor="none",
        markeredgecolor="grey",
        label="frontier",
        zorder=2,
    )
    axes.set_xscale("log")
    axes.set_yscale("log")
    _plain_ticks(axes.xaxis, [p[2] for p in found])
    _plain_ticks(axes.yaxis, [p[3] for p in found])
    axes.set_xlabel(labels[0] + " (log)")
    axes.set_ylabel(labels[1] + " (log; lower is better)")
    axes.grid(True, which="both", alpha=0.3)
    axes.margins(0.12)


def draw(table: dict, path: Path, subtitle: str) -> Path | None:
    """Writes the chart to `path`; None (nothing written) without matplotlib or points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels, (_, quality_label) = PANELS[table["model"]]
    found = {key: points(table, key) for key, _ in panels}
    drawn = [(key, label) for key, label in panels if found[key]]
    if not drawn:
        return None
    families = sorted({p[1] for ps in found.values() for p in ps}, key=lambda f: (f != OURS, f))
    palette = plt.get_cmap("tab10")
    colours = {family: palette(index % 10) for index, family in enumerate(families)}
    figure, axes_row = plt.subplots(1, len(drawn), figsize=(8 * len(drawn), 7), dpi=110)
    axes_list = axes_row if len(drawn) > 1 else [axes_row]
    for axes, (key, label) in zip(axes_list, drawn):
        _panel(axes, found[key], colours, (label, quality_label))
    handles, names = axes_list[0].get_legend_handles_labels()
    figure.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    figure.suptitle(f"{table['model']}: time against quality\n{subtitle}", fontsize=10)
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    for axes, (key, _) in zip(axes_list, drawn):  # once the layout is fixed
        place_labels(axes, found[key], {p[0] for p in frontier(found[key])})
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
