"""Plain-text tables and number formats for the benchmark reports."""

from __future__ import annotations


def fmt(value: object) -> str:
    """Thousands separators for ints, two decimals for floats."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


def percent(fraction: float) -> str:
    """A fraction as the reports print it: ``0.6789`` -> ``"67.9%"`` (the JSON keeps 0.6789)."""
    return f"{100 * fraction:.1f}%"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def table(headers: list[str], rows: list[list[object]]) -> str:
    """Columns padded to width: the first left-aligned, the others right-aligned."""
    cells = [headers] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        first = row[0].ljust(widths[0])
        rest = (cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])
