"""The terminal plot renderer on series whose drawing is known."""
import pytest

from csrc.errors import ConfigError
from offload.cli.termplot import bucket_means, describe_columns, plot_lines


def test_bucket_means():
    assert bucket_means([1, 2, 3, 4, 5, 6], 3) == [1.5, 3.5, 5.5]
    assert bucket_means([1, 2, 3, 4, 5], 2) == [1.5, 4.0]
    assert bucket_means([4, 2], 10) == [4, 2]


def test_one_row_uses_the_eighths():
    assert plot_lines(list(range(8)), width=8, height=1, fmt="{:.0f}") == ["7 ┤▁▂▃▄▅▆▇█"]


def test_two_rows_stack_full_and_partial_blocks():
    lines = plot_lines([0.0, 15.0, 7.5], width=3, height=2, fmt="{:.1f}")
    # levels 1, 16 and 1 + round(0.5 * 15) = 9: the top row draws what is above eight.
    assert lines == ["15.0 ┤ █▁",
                     " 0.0 ┤▁██"]


def test_falling_series_is_drawn_left_high():
    # Column means 3.5, 2.35, 2.05 over 24 levels: 24, 1 + round(0.3 / 1.45 * 23) = 6, and 1.
    assert plot_lines([4.0, 3.0, 2.5, 2.2, 2.1, 2.0], width=3, height=3) == ["3.50 ┤█  ",
                                                                          "     ┤█  ",
                                                                          "2.05 ┤█▆▁"]


def test_constant_series_is_full_height():
    assert plot_lines([2.0, 2.0], width=2, height=2, fmt="{:.0f}") == ["2 ┤██", "2 ┤██"]


def test_empty_series_is_an_error():
    with pytest.raises(ConfigError):
        plot_lines([])


@pytest.mark.parametrize("count, width, text", [(300, 60, "mean of 5 steps per column"),
                                                (42, 8, "mean of 5-6 steps per column"),
                                                (3, 60, "one step per column"),
                                                (60, 60, "one step per column")])
def test_describe_columns_counts_the_values_a_column_averages(count, width, text):
    """42 steps in 8 columns: buckets of 5 and 6 (bucket_means: sizes differ by at most one)."""
    assert describe_columns(count, width) == text


def test_labels_are_the_highest_and_lowest_column_mean():
    values = [9.0, 1.0, 5.0, 4.0, 3.0, 2.5]  # column means 5, 4.5, 2.75: the first value is no label
    lines = plot_lines(values, width=3, height=2)
    assert [line.split(" ┤")[0].strip() for line in lines] == ["5.00", "2.75"]
