"""A series as a few lines of text: columns of Unicode block characters (the loss curve).

Each of ``width`` columns is the mean of its share of the series; the column's
height is measured in eighths of a text row, so ``height`` rows resolve
``8 * height`` levels. The lowest value gets one eighth (a column is never blank)
and the highest the full height; a y-axis label marks the top and bottom rows.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from csrc.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["bucket_means", "plot_lines"]

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


def plot_lines(values: Sequence[float], *, width: int = 60, height: int = 4,
               fmt: str = "{:.2f}") -> list[str]:
    """``height`` lines drawing ``values`` (top row first), each ``label + ' ┤' + cells``."""
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
