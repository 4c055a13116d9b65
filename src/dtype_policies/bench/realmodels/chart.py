"""The trade-off chart of a real-model table: time (x, log) against quality
(y), one point per variant, coloured by family, with the frontier (the
variants no other variant beats on both) drawn as a line. Needs matplotlib."""

from __future__ import annotations

from pathlib import Path

# (time column, its label, quality column, its label); lower is better on both.
AXES = {
    "smollm2": ("decode_ms", "ms per token, batch-1 greedy decode", "perplexity", "perplexity"),
    "minilm": (
        "b32x128_ms",
        "ms per call, batch 32 x 128 tokens",
        "cosine_distance",
        "1 - mean cosine to float32",
    ),
}


COSINE_DISTANCE_FLOOR = 1e-6


def points(table: dict) -> list[tuple[str, str, float, float]]:
    """(variant, family, time, quality) of every row with both figures."""
    time_key, _, quality_key, _ = AXES[table["model"]]
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


def frontier(found: list[tuple[str, str, float, float]]) -> list[tuple[str, str, float, float]]:
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


def draw(table: dict, path: Path, subtitle: str) -> Path | None:
    """Writes the chart to `path`; None (nothing written) without matplotlib or points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    found = points(table)
    if not found:
        return None
    _, time_label, _, quality_label = AXES[table["model"]]
    figure, axes = plt.subplots(figsize=(9, 6), dpi=110)
    families = sorted({p[1] for p in found}, key=lambda f: (f != "dtype-policies", f))
    colours = plt.get_cmap("tab10")
    for index, family in enumerate(families):
        mine = [p for p in found if p[1] == family]
        axes.scatter(
            [p[2] for p in mine],
            [p[3] for p in mine],
            label=family,
            color=colours(index),
            marker="o" if family == "dtype-policies" else "s",
            zorder=3,
        )
    for name, _, x, y in found:
        axes.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    edge = frontier(found)
    axes.step(
        [p[2] for p in edge],
        [p[3] for p in edge],
        where="post",
        color="grey",
        linestyle="--",
        linewidth=1,
        label="frontier",
        zorder=2,
    )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel(time_label + " (log)")
    axes.set_ylabel(quality_label + " (log; lower is better)")
    axes.set_title(f"{table['model']}: speed against quality\n{subtitle}", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
