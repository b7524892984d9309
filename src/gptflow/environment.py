"""Process environment helpers shared by the workflow and the CLI."""

import os
import sys
from pathlib import Path


def put_interpreter_bin_first() -> None:
    """Put this interpreter's bin directory first on PATH for child processes.

    Workflow jobs call ``gptflow``: with this, they find the one installed beside the Python
    that runs Snakemake (e.g. ``.venv/bin``) even when that environment is not activated. A
    conda environment activated for a rule still comes first on that rule's PATH.
    """
    own = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != own:
        os.environ["PATH"] = f"{own}{os.pathsep}{path}" if path else own
