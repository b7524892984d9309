"""Deprecated: ``gptflow.train.snapshot`` is :mod:`gptflow.train.async_save` since gptflow 0.2; this
alias, kept for scripts that import the old name, goes in 0.3 (CHANGELOG.md)."""

import warnings

from gptflow.train.async_save import *  # noqa: F403

warnings.warn(
    "gptflow.train.snapshot is gptflow.train.async_save now; the old name goes in gptflow 0.3",
    DeprecationWarning,
    stacklevel=2,
)
