"""Printing tables, progress and JSON for the command line: rich when it is
installed and stdout is a terminal, plain text otherwise."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from dtype_policies._json import strict
from dtype_policies.apply.summary import render_table

try:
    import rich.console
    import rich.measure
    import rich.progress
    import rich.table
except ImportError:  # the `cli` extra is not installed: plain text
    rich = None  # type: ignore[assignment]  # the optional module's absence


def fancy() -> bool:
    """Whether to draw with rich (installed, and stdout is a terminal)."""
    return rich is not None and sys.stdout.isatty()


def print_table(
    title: str, header: list[str], rows: list[list[Any]], numeric: int = 0, footer: str = ""
) -> None:
    """Prints a table; the last `numeric` columns are right-aligned. No text
    (a module path, a policy name) is ever cut: a table wider than the
    terminal is printed as plain text (the terminal wraps its lines), and
    rich folds a cell rather than cut it."""
    cells = [[_text(cell) for cell in row] for row in rows]
    if fancy():
        table = rich.table.Table(title=title, caption=footer or None)
        for i, name in enumerate(header):
            table.add_column(
                name,
                justify="right" if i >= len(header) - numeric else "left",
                overflow="fold",
                no_wrap=False,
            )
        for row in cells:
            table.add_row(*row)
        console = rich.console.Console()
        unbounded = console.options.update_width(sys.maxsize)  # the table's natural width
        if rich.measure.Measurement.get(console, unbounded, table).maximum <= console.width:
            console.print(table)
            return
    print(title)
    print(render_table(tuple(header), [tuple(row) for row in cells], numeric))
    if footer:
        print(footer)


def print_json(data: Any) -> None:
    json.dump(strict(data), sys.stdout, indent=2, default=str, allow_nan=False)
    sys.stdout.write("\n")


def progress(items: Iterable[Any], total: int, description: str) -> Iterator[Any]:
    """Yields `items` with a progress bar (on stderr; a line per 10% without rich)."""
    if rich is not None and sys.stderr.isatty():
        yield from rich.progress.track(
            items, total=total, description=description, console=rich.console.Console(stderr=True)
        )
        return
    step = max(1, total // 10)
    for index, item in enumerate(items):
        if index % step == 0 or index == total - 1:
            print(f"{description} {index + 1}/{total}", file=sys.stderr, flush=True)
        yield item


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)
