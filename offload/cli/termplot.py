"""A series as a few lines of text: columns of Unicode block characters (the loss curve).

Each of ``width`` columns is the mean of its share of the series (``bucket_means``;
``describe_columns`` says how many values that is, for a chart's caption); the
column's height is measured in eighths of a text row, so ``height`` rows resolve
``8 * height`` levels. The lowest column mean gets one eighth (a column is never
blank) and the highest the full height; the y-axis labels of the top and bottom rows
are those two means, so they are the series' max and min only where a column holds
one value.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from csrc.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["bucket_means", "describe_columns", "plot_lines"]

# Index k draws a column k eighths high within one row; 0 is an empty cell.
EIGHTHS = " ▁▂▃▄▅▆▇█"


def bucket_means(values: Sequence[float], width: int) -> list[float]:
    """``values`` cut into ``min(width, len(values))`` contiguous buckets whose sizes
    differ by at most one, each replaced by its mean."""
    n = len(values)
    buckets = min(width, n)
    out = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        out.append(sum(values[lo:hi]) / (hi - lo))
    return out


def describe_columns(count: int, width: int, unit: str = "step") -> str:
    """What a column of ``plot_lines(values, width=width)`` draws for ``count`` values, for a caption:
    "one step per column", "mean of 5 steps per column" or "mean of 5-6 steps per column"."""
    if count < 1 or width < 1:
        raise ConfigError(f"describe_columns: count and width must be >= 1, got {count} and {width}")
    buckets = min(width, count)
    fewest, most = count // buckets, -(-count // buckets)
    if most == 1:
        return f"one {unit} per column"
    return f"mean of {fewest if fewest == most else f'{fewest}-{most}'} {unit}s per column"


def plot_lines(values: Sequence[float], *, width: int = 60, height: int = 4,
               fmt: str = "{:.2f}") -> list[str]:
    """``height`` lines drawing ``values`` (top row first), each ``label + ' ┤' + cells``; the top and
    bottom labels are the highest and lowest column mean (``bucket_means(values, width)``)."""
    if not values:
        raise ConfigError("plot_lines: no values to plot")
    if width < 1 or height < 1:
        raise ConfigError(f"plot_lines: width and height must be >= 1, got {width} and {height}")
    cols = bucket_means(values, width)
    lo, hi = min(cols), max(cols)
    levels_max = 8 * height
    span = hi - lo
    levels = [levels_max if span == 0 else 1 + round((v - lo) / span * (levels_max - 1)) for v in cols]
    labels = [fmt.format(hi)] + [""] * (height - 2) + [fmt.format(lo)] if height > 1 else [fmt.format(hi)]
    pad = max(len(s) for s in labels)
    lines = []
    for row in range(height - 1, -1, -1):  # top row first
        cells = "".join(EIGHTHS[min(8, max(0, level - 8 * row))] for level in levels)
        lines.append(f"{labels[height - 1 - row]:>{pad}} ┤{cells}")
    return lines
