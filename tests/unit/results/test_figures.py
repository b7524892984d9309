"""How a page tells its series apart (gptflow.results.figures)."""

from __future__ import annotations

import pytest

from gptflow.results.figures import MARKERS, PALETTE, series_styles


def test_the_first_ten_series_differ_in_colour_and_the_first_ninety_in_colour_or_marker():
    """A study of up to ten runs is told apart by colour alone (and by marker too, for a reader
    who does not see the colour), in the page's order: the i-th run takes the i-th colour;
    up to 90 runs no two share both colour and marker."""
    names = [f"run{i}" for i in range(90)]
    styles = series_styles(names)
    first = [styles[n] for n in names[:10]]
    assert [s.color for s in first] == list(PALETTE)
    assert len({s.marker for s in first[: len(MARKERS)]}) == len(MARKERS)
    assert len({(s.color, s.marker) for s in styles.values()}) == 90
    assert series_styles(names[:3]) == {n: styles[n] for n in names[:3]}  # order, not count
    with pytest.raises(ValueError, match="repeat"):
        series_styles(["a", "b", "a"])
