"""The plan, built in-process (gptflow.plan.build.build_plan) as `snakemake -n` builds it in
rules/setup.smk: the config, every run's settings built once, the datasets, the preflight, and
every refusal as the one line -n prints. tests/workflow/test_bad_input.py runs a few of these
through Snakemake itself (the wrapper: one line, no traceback, nothing written)."""

from __future__ import annotations

import copy

import pytest

from gptflow.config import settings
from gptflow.plan.build import PlanError, build_plan
from gptflow.plan.profile import Profile
from tests.workflow.test_bad_input import CASES

NO_GPU = (lambda: (0, "no nvidia-smi on PATH"), lambda: (None, "no nvidia-smi"))


@pytest.fixture
def plan_of(repo, tmp_path, monkeypatch, write_yaml):
    """plan_of(cfg, profile=Profile(), main_process=True) -> Plan, in an empty working
    directory, `cfg` written to a file as --configfile gives it."""
    work = tmp_path / "wd"
    work.mkdir()
    monkeypatch.chdir(work)

    def plan(cfg: dict, profile: Profile | None = None, main_process: bool = True):
        path = write_yaml(tmp_path / "config.yaml", cfg)
        return build_plan(
            copy.deepcopy(cfg), repo=repo, profile=profile or Profile(),
            config_files=[str(path)], main_process=main_process,
            visible_gpus=NO_GPU[0], gpu_memory_mib=NO_GPU[1],
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


def test_the_tiny_configs_plan(plan_of, tiny_config):
    plan = plan_of(tiny_config)
    (run,) = plan.runs.values()
    assert run.name == tiny_config["run"] and run.train.seq_length == 64
    assert run.model.num_parameters() == 165_632  # vocabulary 500 padded to 512
    assert list(plan.datasets) == ["stdlib"] and plan.blended == ["stdlib"]
    assert list(plan.indexes) == [plan.index_of[run.name]]
    assert plan.placement.executor == "local" and plan.local_gpus == 0
    assert plan.preflight.lines[0].startswith("gptflow preflight: train_gpt on 1 rank(s)")
    assert plan.largest == run.name and plan.study is None


def test_a_study_builds_each_runs_settings_once(plan_of, tiny_config, monkeypatch):
    """Each run's TrainConfig is made when its config is checked and once for the plan, not
    again by each stage that reads it (the harness's steps, the preflight, the study's table,
    the largest run's choice)."""
    import inspect

    made = []
    init = settings.TrainConfig.__init__

    def counted(self, *args, **kwargs):
        caller = inspect.stack()[1]
        if caller.function != "replace":  # dataclasses.replace: a setting decided (auto)
            made.append(f"{caller.filename}:{caller.function}")
        init(self, *args, **kwargs)

    monkeypatch.setattr(settings.TrainConfig, "__init__", counted)
    cfg = {**tiny_config, "study": {"grid": {"train.lr": [1e-3, 2e-3, 4e-3]}}}
    plan = plan_of(cfg)
    assert len(plan.runs) == 3
    # the base and each run checked (workflow_config), then each run's plan (runs.run_plan)
    assert len(made) == 1 + 3 + 3, made
    assert any(line.startswith("gptflow study: 3 run(s)") for line in plan.preflight.lines)


def test_a_jobs_own_snakemake_skips_the_preflight_and_the_tokenizer(plan_of, tiny_config):
    """main_process False (a job's Snakemake parses the workflow again): no preflight, and no
    run's vocabulary read from the tokenizer file."""
    plan = plan_of(tiny_config, main_process=False)
    assert plan.preflight is None
    assert all("vocabulary" not in vars(r) for r in plan.runs.values())


def test_the_profile_places_training(plan_of, tiny_config):
    """The profile's set-resources place train_gpt (8 ranks on two nodes), read by the
    preflight like Slurm's plugin: the global batch is whole micro-batches on every rank."""
    profile = Profile(
        resources={"train_gpt": {"slurm_partition": "gpu", "nodes": 2, "tasks_per_node": 4,
                                 "gres": "gpu:4", "mpi": "srun", "gpu_mem_mb": 81920,
                                 "mem_mb": 256000}},
        defaults={"slurm_account": "proj", "slurm_partition": "cpu", "runtime": 60},
        threads={"train_gpt": 8},
    )  # fmt: skip
    cfg = copy.deepcopy(tiny_config)
    cfg["train"].update(global_batch_size=32, micro_batch_size=4)
    p = plan_of(cfg, profile=profile).placement
    assert (p.executor, p.nodes, p.tasks_per_node, p.ranks, p.threads) == ("slurm", 2, 4, 8, 8)
    assert ("default-resources slurm_account", "proj") in p.settings


def test_a_refusal_is_one_line_with_its_stages_prefix(plan_of, tiny_config):
    cfg = copy.deepcopy(tiny_config)
    cfg["train"]["seq_length"] = 4096
    with pytest.raises(PlanError) as e:
        plan_of(cfg)
    line = str(e.value)
    assert line.startswith("gptflow config: ") and "\n" not in line
    assert "train.seq_length 4096 exceeds model.max_position_embeddings 2048; raise" in line
    with pytest.raises(PlanError) as e:
        plan_of(tiny_config, profile=Profile(resources={"train_gpt": {"nproc_per_node": 3}}))
    assert str(e.value).startswith("gptflow preflight (") and "micro_batch_size 4 x 3 ranks" in str(
        e.value
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_bad_config_is_one_line_naming_the_key_and_the_file(case, plan_of, tmp_path):
    """tests/workflow/test_bad_input.py's cases, each as the line -n prints; two of them also
    through Snakemake there."""
    cfg, message = CASES[case]
    with pytest.raises(PlanError) as e:
        plan_of(cfg)
    line = str(e.value)
    assert line.startswith("gptflow config:") and "\n" not in line
    assert message in line
    assert str(tmp_path / "config.yaml") in line  # names the file to fix
    assert not (tmp_path / "wd" / "results").exists()
