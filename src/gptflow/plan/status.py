"""Deprecated: ``gptflow.plan.status`` is :mod:`gptflow.watch.status` since gptflow 0.2; this
alias, kept for scripts that import the old name, goes in 0.3 (CHANGELOG.md)."""

import warnings

from gptflow.watch.status import *  # noqa: F403

warnings.warn(
    "gptflow.plan.status is gptflow.watch.status now; the old name goes in gptflow 0.3",
    DeprecationWarning,
    stacklevel=2,
)
