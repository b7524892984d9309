"""The plan built in-process, as `snakemake -n` builds it (gptflow.plan.build.build_plan)."""

from __future__ import annotations

import copy

import pytest

from gptflow.plan.build import build_plan
from gptflow.plan.profile import Profile

NO_GPU = (lambda: (0, "no nvidia-smi on PATH"), lambda: (None, "no nvidia-smi"))


@pytest.fixture
def plan_of(repo, tmp_path, monkeypatch, write_yaml):
    """plan_of(cfg, profile=Profile(), main_process=True, gpus=NO_GPU) -> Plan, in an empty
    working directory, `cfg` written to a file as --configfile gives it; `gpus`: what
    nvidia-smi would say (a stand-in: no GPU exists here)."""
    work = tmp_path / "wd"
    work.mkdir()
    monkeypatch.chdir(work)

    def plan(cfg: dict, profile: Profile | None = None, main_process: bool = True, gpus=NO_GPU):
        path = write_yaml(tmp_path / "config.yaml", cfg)
        return build_plan(
            copy.deepcopy(cfg), repo=repo, profile=profile or Profile(),
            config_files=[str(path)], main_process=main_process,
            visible_gpus=gpus[0], gpu_memory_mib=gpus[1],
            sinfo=lambda: None, accounts=lambda: None,
        )  # fmt: skip

    return plan


@pytest.fixture
def write_yaml():
    import yaml

    def write(path, cfg):
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    return write
