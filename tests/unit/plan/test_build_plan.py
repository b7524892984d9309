"""The plan, built in-process (gptflow.plan.build.build_plan) as `snakemake -n` builds it in
rules/setup.smk: the config, every run's settings built once, the datasets, the preflight, and
every refusal as the one line -n prints. tests/workflow/test_bad_input.py runs a few of these
through Snakemake itself (the wrapper: one line, no traceback, nothing written)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from gptflow.config import settings
from gptflow.plan.build import PlanError
from gptflow.plan.profile import Profile
from tests.workflow.test_bad_input import CASES


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


def test_a_rules_own_resource_wins_even_when_only_its_job_knows_it():
    """Profile.value reads a resource as the executor plugin will: the rule's set-resources,
    else default-resources. A set-resources the plan cannot evaluate (a function of the job:
    None here) is the rule's, known when the job runs: not the default's value."""
    profile = Profile(resources={"train_gpt": {"runtime": None, "nodes": 2}},
                      defaults={"runtime": 60, "nodes": 1, "mem_mb": 8000})  # fmt: skip
    assert profile.value("train_gpt", "runtime") is None and profile.sets("train_gpt", "runtime")
    assert profile.value("train_gpt", "nodes") == 2
    assert profile.value("train_gpt", "mem_mb") == 8000  # not set for the rule: the default
    assert profile.value("evaluate", "runtime") == 60 and not profile.sets("evaluate", "runtime")


def test_a_nodes_memory_is_what_its_job_is_given():
    """The node memory the background saves' check holds training to: Slurm's plugin passes
    default-resources mem_mb as train_gpt's --mem, so there it counts; PBS's submit line and
    this machine pass none, so only train_gpt's own mem_mb does (profiles/pbs's default 8000
    is the CPU jobs': counted, it refused every 4-GPU node)."""
    from gptflow.plan.profile import default_resources, placement

    no_gpus = lambda: (None, "none")  # noqa: E731
    # as Snakemake hands the profile's default-resources to rules/setup.smk: words, quoted
    defaults = default_resources(["mem_mb=8000", "slurm_account='lab'", 'runtime="60"'])
    assert defaults == {"mem_mb": 8000, "slurm_account": "lab", "runtime": 60}
    slurm = Profile(resources={"train_gpt": {"slurm_partition": "gpu"}}, defaults=defaults)
    pbs = Profile(resources={"train_gpt": {"pbs_queue": "gpuq"}}, defaults=defaults)
    pbs_own = Profile(resources={"train_gpt": {"pbs_queue": "gpuq", "mem_mb": 500000}},
                      defaults=defaults)  # fmt: skip
    local = Profile(defaults=defaults)
    mem = {
        name: placement(p, no_gpus, no_gpus).mem_mb
        for name, p in [("slurm", slurm), ("pbs", pbs), ("pbs_own", pbs_own), ("local", local)]
    }
    assert mem == {"slurm": 8000, "pbs": None, "pbs_own": 500000, "local": None}


def test_a_pbs_queue_for_every_job_places_training_on_pbs(plan_of, tiny_config):
    """profiles/pbs gives its queue to every job (default-resources pbs_queue), or to
    train_gpt alone; either way training is placed on PBS."""
    given = {"pbs_select": "select=1:ngpus=4", "nodes": 1, "tasks_per_node": 4,
             "gres": "gpu:4", "mpi": "mpiexec", "gpu_mem_mb": 40960}  # fmt: skip
    cfg = copy.deepcopy(tiny_config)
    cfg["train"].update(global_batch_size=16, micro_batch_size=4)
    for profile in (Profile(resources={"train_gpt": given}, defaults={"pbs_queue": "workq"}),
                    Profile(resources={"train_gpt": {**given, "pbs_queue": "gpuq"}})):  # fmt: skip
        assert plan_of(cfg, profile=profile).placement.executor == "pbs"
    assert plan_of(cfg, profile=Profile(resources={"train_gpt": given})).placement.executor != "pbs"


def test_a_data_ablations_runs_clean_with_their_own_recipes(plan_of, tiny_config):
    """A study run with its own data.quality has its recipe and its shards (variants, data
    index); a run without shares the base's recipe (the same object) and index."""
    exact = {"data": {"quality": {"steps": [{"step": "exact"}]}}}
    cfg = {**copy.deepcopy(tiny_config), "run": "ablation",
           "study": {"runs": {"raw": {}, "exact": exact}}}  # fmt: skip
    plan = plan_of(cfg)
    assert plan.run_quality["raw"] is plan.quality == {}
    assert [s.kind for s in plan.run_quality["exact"]["stdlib"]] == ["exact"]
    assert plan.run_variants["raw"] == plan.base_variants == {"stdlib": "raw"}
    (step,) = plan.run_quality["exact"]["stdlib"]
    assert plan.run_variants["exact"] == {"stdlib": step.name}
    assert plan.index_of["raw"] != plan.index_of["exact"]
    assert list(plan.quality_step) == [("stdlib", step.name)]


def test_the_model_is_counted_with_the_tokenizer_on_disk(plan_of, tiny_config):
    """Once the run's tokenizer exists, its vocabulary sizes the model (the preflight's
    parameters); before, the size it is to be trained to."""
    from gptflow import paths

    before = plan_of(tiny_config)
    (run,) = before.runs.values()
    assert run.vocab_source == "tokenizer.train.vocab_size"
    path = Path(paths.tokenizer_json(tiny_config["tokenizer"]["name"]))
    path.parent.mkdir(parents=True)
    vocab = {f"t{i}": i for i in range(700)}
    path.write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    (run,) = plan_of(tiny_config).runs.values()
    assert (run.vocab, run.vocab_source) == (700, str(path))
    assert run.model.vocab_size == 768  # padded to a multiple of 128
    assert "vocabulary 700" in plan_of(tiny_config).preflight.lines[0]


def test_a_studys_preflight_is_its_largest_runs(plan_of, tiny_config):
    cfg = {**copy.deepcopy(tiny_config), "run": "sizes",
           "study": {"grid": {"model.preset": ["small", "tiny"]}}}  # fmt: skip
    plan = plan_of(cfg)
    assert plan.largest == "small"
    assert "(largest run: small)" in plan.preflight.lines[0]


def test_a_sequence_as_long_as_the_models_positions_fits(plan_of, tiny_config):
    cfg = copy.deepcopy(tiny_config)
    cfg["train"]["seq_length"] = cfg["model"].get("max_position_embeddings", 2048)
    cfg["model"]["max_position_embeddings"] = cfg["train"]["seq_length"]
    assert plan_of(cfg).runs[cfg["run"]].train.seq_length == cfg["train"]["seq_length"]


def test_gpus_here_are_shared_only_where_training_runs_here(plan_of, tiny_config):
    """The jobs share this machine's GPUs (the `gpu` resource) only where training runs on
    this machine without srun: under srun (a cluster's launcher) it offers none."""
    here = (lambda: (2, "nvidia-smi -L"), lambda: (4096, "nvidia-smi"))
    assert plan_of(tiny_config, gpus=here).local_gpus == 2
    srun = Profile(resources={"train_gpt": {"mpi": "srun", "nodes": 1, "tasks_per_node": 2}})
    assert plan_of(tiny_config, gpus=here, profile=srun).local_gpus == 0


def test_a_refusal_after_the_preflight_prints_the_preflight_first(plan_of, tiny_config):
    """The container check comes after the preflight: its refusal carries the preflight's
    report, whose lines the plan prints before the refusal (as -n did)."""
    cfg = copy.deepcopy(tiny_config)
    cfg["container"] = {"enabled": True, "format": "sif", "dockerfile": "envs/NoSuch"}
    with pytest.raises(PlanError) as e:
        plan_of(cfg)
    assert "container.dockerfile is 'envs/NoSuch'" in str(e.value)
    assert e.value.preflight.lines[0].startswith("gptflow preflight: train_gpt on 1 rank(s)")
