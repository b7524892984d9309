"""Deprecated: ``gptflow.plan.why`` is :mod:`gptflow.watch.why`, and the config records it
wrote are :mod:`gptflow.plan.records`, since gptflow 0.2; this alias, kept for scripts that
import the old name, goes in 0.3 (CHANGELOG.md)."""

import warnings

from gptflow.plan.records import *  # noqa: F403
from gptflow.watch.why import *  # noqa: F403

warnings.warn(
    "gptflow.plan.why is gptflow.watch.why (and gptflow.plan.records) now; the old name goes "
    "in gptflow 0.3",
    DeprecationWarning,
    stacklevel=2,
)
