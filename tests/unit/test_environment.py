"""versions(): what the run card, DONE.json and `gptflow --version` report."""

import json
import subprocess
import sys
from importlib import metadata

import gptflow
from gptflow.environment import versions


def test_versions_of_this_environment():
    import torch

    v = versions()
    assert v["gptflow"] == gptflow.__version__
    assert v["python"] == sys.version.split()[0]
    assert v["torch"] == torch.__version__ == metadata.version("torch")
    assert v["deepspeed"] == metadata.version("deepspeed")
    assert v["snakemake"] == metadata.version("snakemake")
    assert v["snakemake-executor-plugin-slurm"] == metadata.version(
        "snakemake-executor-plugin-slurm"
    )
    assert v.get("cuda") == torch.version.cuda  # absent on this CPU build: no key, not "None"
    assert list(v) == [
        "gptflow", "python", "torch", "deepspeed", "snakemake", "snakemake-executor-plugin-slurm"
    ]  # fmt: skip


def test_cuda_is_read_from_torch_version_py_without_importing_torch_or_deepspeed(tmp_path):
    """A CUDA build's torch/version.py (as pip's cu128 wheels write it), found first on the
    path: its cuda is reported, and neither torch, deepspeed nor snakemake gets imported."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    (fake / "version.py").write_text(
        "from typing import Optional\n\n__version__ = '2.13.0+cu128'\ndebug = False\n"
        "cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n"
    )
    code = (
        "import json, sys; from gptflow.environment import versions; v = versions(); "
        "print(json.dumps([v, *(m in sys.modules for m in ('torch', 'deepspeed', 'snakemake'))]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    v, *imported = json.loads(out.stdout)
    assert v["cuda"] == "12.8" and imported == [False, False, False]
    assert v["snakemake"] == metadata.version("snakemake")  # read from its metadata
