"""Deprecated: ``gptflow.plan.after_training`` is :mod:`gptflow.plan.eval_size` since gptflow
0.2; this alias, kept for scripts that import the old name, goes in 0.3 (CHANGELOG.md)."""

import warnings

from gptflow.plan.eval_size import *  # noqa: F403

warnings.warn(
    "gptflow.plan.after_training is gptflow.plan.eval_size now; the old name goes in gptflow 0.3",
    DeprecationWarning,
    stacklevel=2,
)
