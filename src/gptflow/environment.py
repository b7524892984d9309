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


# the distributions versions() reports besides gptflow and Python, under their own names
DISTRIBUTIONS = ("torch", "deepspeed", "snakemake", "snakemake-executor-plugin-slurm")


def versions() -> dict[str, str]:
    """The versions of what gptflow runs on here: gptflow, Python, torch, DeepSpeed,
    Snakemake and its Slurm executor plugin, and the CUDA that torch was built with when it
    was (no key on a CPU build), for the run card, DONE.json and ``gptflow --version``.

    Read from the installed distributions' metadata and ``torch/version.py``, without
    importing torch, DeepSpeed or Snakemake (seconds, and DeepSpeed logs on import). A
    package that is not installed is "not installed"."""
    from importlib import metadata

    import gptflow

    out = {"gptflow": gptflow.__version__, "python": sys.version.split()[0]}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    cuda = _torch_cuda()
    if cuda:
        out["cuda"] = cuda
    return out


def _torch_cuda() -> str | None:
    """``torch.version.cuda`` (e.g. "12.8"; None for a CPU build): from the imported module
    when torch is loaded, else parsed from torch/version.py."""
    if "torch" in sys.modules:
        return getattr(getattr(sys.modules["torch"], "version", None), "cuda", None)
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target = getattr(node, "target", None) or next(iter(getattr(node, "targets", [])), None)
        if isinstance(target, ast.Name) and target.id == "cuda" and node.value is not None:
            value = ast.literal_eval(node.value)
            return value if isinstance(value, str) else None
    return None
