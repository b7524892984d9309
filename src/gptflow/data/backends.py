"""Deprecated: ``gptflow.data.backends`` is :mod:`gptflow.data.engines` since gptflow 0.2; this
alias, kept for scripts that import the old name, goes in 0.3 (CHANGELOG.md)."""

import warnings

from gptflow.data.engines import *  # noqa: F403
from gptflow.data.engines import ENGINES as BACKENDS  # noqa: F401  (the old names)
from gptflow.data.engines import GigatokenEngine as GigatokenBackend  # noqa: F401
from gptflow.data.engines import HFEngine as HFBackend  # noqa: F401
from gptflow.data.engines import select_engine as select_backend  # noqa: F401

warnings.warn(
    "gptflow.data.backends is gptflow.data.engines now; the old name goes in gptflow 0.3",
    DeprecationWarning,
    stacklevel=2,
)
