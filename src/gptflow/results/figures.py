"""How the results pages tell their series apart, and how their figures are written.

One palette and one rule: the series of a page (a study's runs, the data-quality page's
recipes, a harness task's metrics) get their styles once, in the page's order, from
:func:`series_styles`, and every figure and table of the page uses that mapping, so a run
has the same colour and marker in each figure and leads its table row with the same mark
(:meth:`SeriesStyle.mark`). Figures are matplotlib's, written as SVG (inlined in the pages,
and files for `snakemake --report`); each series' group carries the id ``FIGURE:SERIES``
(:func:`series_id`), which is how tests find a run's line in a figure.
"""

from __future__ import annotations

import html
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

from gptflow.fsutil import atomic_write

# matplotlib's tab10 (its default cycle): ten colours told apart on screen and in print
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip
# nine markers (coprime with ten colours: the first 90 series each have their own pair, so
# a series stays told apart in grey print or by a reader who does not see a colour), each
# with the character a table shows for it
MARKERS = {"o": "●", "s": "■", "^": "▲", "D": "◆", "v": "▼", "<": "◀", ">": "▶", "*": "★",
           "X": "✖"}  # fmt: skip
LINESTYLES = ("-", "--", ":", "-.")  # after 90 series: (colour, marker, line style) to 360


@dataclass(frozen=True)
class SeriesStyle:
    """One series' look in every figure of its page."""

    color: str
    marker: str
    linestyle: str = "-"

    def kwargs(self) -> dict:
        """matplotlib's plot() keywords."""
        return {"color": self.color, "marker": self.marker, "linestyle": self.linestyle}

    def mark(self, name: str) -> str:
        """The series' marker character in its colour, as HTML (a table cell's lead)."""
        return (
            f"<span class='mark' style='color:{self.color}' title='{html.escape(name)} in the "
            f"figures'>{MARKERS[self.marker]}</span>"
        )


def series_styles(names: Sequence[str]) -> dict[str, SeriesStyle]:
    """Each of `names` (the page's series, in the page's order) its own colour and marker:
    the i-th takes colour i mod 10 and marker i mod 9, so no two of the first 90 look alike
    and the first ten differ in colour."""
    if len(set(names)) != len(names):
        raise ValueError(f"series names repeat: {list(names)}")
    colours, markers = len(PALETTE), len(MARKERS)
    return {
        name: SeriesStyle(
            color=PALETTE[i % colours],
            marker=list(MARKERS)[i % markers],
            linestyle=LINESTYLES[i // (colours * markers) % len(LINESTYLES)],
        )
        for i, name in enumerate(names)
    }


def series_id(figure: str, series: str) -> str:
    """The SVG id of a series' group in a figure (matplotlib's gid)."""
    return f"{figure}:{series}"


def new_figure(rows: int = 1, cols: int = 1, *, width: float = 7.0, height: float = 4.0):
    """(figure, 2-D array of axes) of matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=(width, height), dpi=100, squeeze=False)


def svg_text(fig) -> str:
    """The figure as SVG text (the figure closed)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    plt.close(fig)
    return buffer.getvalue()


def write_svg(fig, path: str | os.PathLike) -> str:
    """The figure written to `path` as SVG, atomically; returns the path."""
    text = svg_text(fig)
    with atomic_write(path) as f:
        f.write(text)
    return str(path)


def inline(svg: str) -> str:
    """An SVG's <svg> element, without the XML declaration and doctype (to put in HTML)."""
    return svg[svg.index("<svg") :]


def say(ax, text: str) -> None:
    """A panel that says why it has no points, in place of an empty axis."""
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])
