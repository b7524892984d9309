"""Deprecated: ``gptflow.data.tokenize`` is :mod:`gptflow.data.shards` since gptflow 0.2; this
alias, kept for scripts that import the old name, goes in 0.3 (CHANGELOG.md)."""

import warnings

from gptflow.data.shards import *  # noqa: F403

warnings.warn(
    "gptflow.data.tokenize is gptflow.data.shards now; the old name goes in gptflow 0.3",
    DeprecationWarning,
    stacklevel=2,
)
