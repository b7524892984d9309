"""Sphinx configuration of gptflow's documentation site: `make docs`.

The pages are plain Markdown (MyST-Parser reads CommonMark and GitHub's tables), readable as
they are on a code host. The source directory is the repository itself, so that README.md,
config/README.md, profiles/README.md and CHANGELOG.md are pages of the site with the same relative links a
code host follows; only the files matched by `include_patterns` are read.

    sphinx-build -W --keep-going -n -c docs -b html . docs/_build/html

`-W` makes every warning an error: a link to a missing page, heading anchor or file, and a
page in no table of contents (tests/unit/test_docs.py builds the site in the suite and checks
that both fail).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the pages; every other file is only linked to
SOURCES = ["README.md", "CHANGELOG.md", "docs/*.md", "config/README.md", "profiles/README.md"]

project = "gptflow"
author = "the gptflow developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "docs/index"
include_patterns = SOURCES
# Directories the build never walks into (Sphinx prunes excluded directories): all but the
# ones holding pages and the files they link to.
exclude_patterns = [
    "docs/_build",
    *sorted(
        p.name
        for p in ROOT.iterdir()
        if p.is_dir() and (p.name.startswith(".") or p.name in {"results", "resources", "logs"})
    ),
]

# Markdown as a code host shows it: `[text](page.md#a-heading)` links, GitHub's heading slugs
myst_heading_anchors = 4
myst_enable_extensions = ["strikethrough"]
suppress_warnings: list[str] = []  # none: a broken link or an orphan page fails the build

html_theme = "alabaster"
html_title = "gptflow"
html_theme_options = {"description": "raw text to a trained GPT checkpoint", "fixed_sidebar": True}
html_sidebars = {"**": ["about.html", "navigation.html", "searchbox.html"]}
html_copy_source = False
html_show_sourcelink = False

REDIRECT = '<!doctype html><meta http-equiv="refresh" content="0; url=docs/index.html">\n'


def setup(app):
    """The site's root index.html: its front page is docs/index.html (the pages keep their
    places in the repository, so that their relative links work on a code host too)."""

    def write_redirect(app, exception):
        if exception is None and app.builder.format == "html":
            (Path(app.outdir) / "index.html").write_text(REDIRECT)

    app.connect("build-finished", write_redirect)
