"""Autotune's search space, planned in-process (gptflow.plan.autotune through build_plan): the
candidates, each admitted or refused by the preflight's own checks (the memory per GPU on a
GPU profile: a stand-in placement, no GPU exists here), the trials as runs, and the refusals
of the autotune section in one line."""

from __future__ import annotations

import copy

import pytest

from gptflow.plan import autotune
from gptflow.plan.build import PlanError
from gptflow.plan.gpu_memory import memory_per_gpu
from gptflow.plan.profile import Profile
from gptflow.train.trial import trial_command

GPUS_OF_4_GB = Profile(
    resources={"train_gpt": {"slurm_partition": "gpu", "nodes": 1, "tasks_per_node": 4,
                             "gres": "gpu:4", "mpi": "srun", "gpu_mem_mb": 4096,
                             "mem_mb": 256000}},
    defaults={"slurm_account": "proj", "slurm_partition": "cpu", "runtime": 60},
    threads={"train_gpt": 8},
)  # fmt: skip


def with_autotune(cfg: dict, **spec) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["autotune"] = spec
    return cfg


def test_the_default_search_is_every_split_of_the_batch_by_stage_and_checkpointing(
    plan_of, tiny_config
):
    plan = plan_of(with_autotune(tiny_config))  # global batch 8 on one rank, micro 4
    names = [c.name for c in plan.candidates]
    assert len(names) == 4 * 4 * 2 and len(set(names)) == 32
    assert names[:3] == ["tiny.tune.mb1.z0.ac0", "tiny.tune.mb1.z0.ac1", "tiny.tune.mb1.z1.ac0"]
    assert {c.micro_batch_size for c in plan.candidates} == {1, 2, 4, 8}
    assert all(c.admitted for c in plan.candidates)  # fp32 on a CPU: every stage trains
    assert {c.name: c.grad_accum for c in plan.candidates}["tiny.tune.mb2.z3.ac1"] == 4
    # each trial is a run of its own, read by the rules as a run is
    assert list(plan.trials) == names and set(plan.every_run) == {"tiny", *names}
    trial = plan.trials["tiny.tune.mb2.z3.ac1"]
    assert (trial.train.micro_batch_size, trial.train.zero_stage) == (2, 3)
    assert trial.model.activation_checkpointing and trial.train.autotune_trial
    assert not plan.runs["tiny"].train.autotune_trial  # the run itself evaluates and saves
    assert trial.model.num_parameters() == plan.runs["tiny"].model.num_parameters()
    # the trials read the same samples: one data index, not the run's (fewer steps)
    assert len({plan.index_of[t] for t in names}) == 1
    assert plan.index_of[names[0]] != plan.index_of["tiny"]
    line = next(x for x in plan.preflight.lines if x.startswith("gptflow autotune:"))
    assert "32 candidate(s)" in line and "32 admitted by the preflight, 0 refused" in line
    assert "each a trial of 10 steps (the first 3 not timed), 0 finished already" in line


def test_the_default_micro_batch_sizes_split_each_ranks_share():
    class Run:
        def __init__(self, micro, batch):
            from gptflow.config.settings import TrainConfig

            self.train = TrainConfig(train_iters=10, micro_batch_size=micro,
                                     global_batch_size=batch)  # fmt: skip

    assert autotune.micro_batch_choices(Run(3, 24), 1) == [1, 2, 3, 4, 8]
    assert autotune.micro_batch_choices(Run(3, 24), 2) == [1, 2, 3, 4]  # 12 a rank
    assert autotune.micro_batch_choices(Run(4, 64), 4) == [1, 2, 4, 8, 16]
    assert autotune.micro_batch_choices(Run(1, 7), 1) == [1]


def test_a_trial_trains_the_candidates_layout_for_a_few_steps_and_nothing_else(tiny_config):
    cfg = copy.deepcopy(tiny_config)
    cfg["train"].update(lr_warmup_iters=4, train_iters=40, keep_every=20, save_interval=10,
                        log_interval=5, tensorboard=True)  # fmt: skip
    cfg["model"] = {"preset": "tiny"}
    cfg["train"]["wandb"] = {"enabled": True, "project": "p"}
    spec = {"steps": 6, "warmup_steps": 2}
    trial = autotune.trial_config(cfg, spec, 2, 1, True)
    t, m = trial["train"], trial["model"]
    assert trial["run"] == "tiny.tune.mb2.z1.ac1"
    assert (t["micro_batch_size"], t["zero_stage"], m["activation_checkpointing"]) == (2, 1, True)
    assert (t["train_iters"], t["log_interval"], t["lr_decay_iters"]) == (6, 1, 40)
    assert t["lr_warmup_iters"] == 4 and t["lr"] == cfg["train"]["lr"]  # the run's schedule
    assert t["autotune_trial"] and t["keep_every"] is None and t["elastic"] is None
    assert not t["tensorboard"] and t["wandb"] == {"enabled": False, "project": "p"}
    assert cfg["train"]["micro_batch_size"] == 4 and "autotune_trial" not in cfg["train"]
    assert trial["data"] is cfg["data"]  # the run's data, not a copy


def test_a_candidate_that_does_not_fit_the_gpu_is_refused_with_the_preflights_reason(
    plan_of, tiny_config
):
    cfg = with_autotune(tiny_config, zero_stages=[0, 3])
    cfg["train"].update(seq_length=2048, global_batch_size=256, micro_batch_size=4)
    plan = plan_of(cfg, profile=GPUS_OF_4_GB)  # 4 GB GPUs, 4 ranks: 64 sequences a rank
    by_name = {c.name: c for c in plan.candidates}
    refused = {name for name, c in by_name.items() if not c.admitted}
    # without activation checkpointing 64 sequences of 2048 tokens do not fit; with it they do
    assert refused == {"tiny.tune.mb64.z0.ac0", "tiny.tune.mb64.z3.ac0"}
    for name in refused:
        assert by_name[name].refused.startswith("the model does not fit in a GPU: about 2.0 GiB")
        assert name not in plan.trials
    assert by_name["tiny.tune.mb64.z0.ac1"].memory == "1.5 GiB of 4.0 GiB"
    # the same function as the preflight's: an admitted one fits, by its own count
    for name in plan.trials:
        trial = plan.trials[name]
        assert memory_per_gpu(trial.model, trial.train, 4, plan.placement).fits
    lines = plan.preflight.lines
    assert "  tiny.tune.mb64.z0.ac0: refused: the model does not fit in a GPU: about" in "\n".join(
        lines
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"study": {"runs": {"a": {}, "b": {"train": {"lr": 1e-3}}}}},
         "autotune searches the layout of one run, and this config is a study of 2: search with"),
        ({"autotune": {"steps": 3, "warmup_steps": 3}},
         "autotune.warmup_steps 3 leaves no timed step of autotune.steps 3: set steps above"),
        ({"autotune": {"micro_batch_sizes": [3, 5]}},
         "the preflight refuses all 16 candidate(s) of autotune, e.g. tiny.tune.mb3.z0.ac0: "
         "train.global_batch_size 8 is not a multiple of train.micro_batch_size 3"),
        ({"autotune": {"zero_stages": [4]}}, "autotune.zero_stages"),
        ({"autotune": {"steps": 1}}, "autotune.steps"),
    ],
)  # fmt: skip
def test_a_bad_autotune_section_is_one_line(plan_of, tiny_config, edit, message):
    cfg = with_autotune(tiny_config)
    cfg.update({k: v for k, v in edit.items() if k != "autotune"})
    cfg["autotune"].update(edit.get("autotune", {}))
    with pytest.raises(PlanError) as e:
        plan_of(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_without_autotune_there_is_no_trial(plan_of, tiny_config):
    plan = plan_of(tiny_config)
    assert plan.candidates == [] and plan.trials == {} and list(plan.every_run) == ["tiny"]
    assert not any(x.startswith("gptflow autotune") for x in plan.preflight.lines)


def test_a_trials_job_runs_its_launcher_behind_autotune_trial():
    assert trial_command("results/runs/t", {"memory_limit_mb": None}, ["srun", "-N2"]) == [
        "gptflow",
        "autotune-trial",
        "--run-dir",
        "results/runs/t",
        "--",
        "srun",
        "-N2",
    ]
    assert trial_command("d", {"memory_limit_mb": 900}, []) == [
        "gptflow",
        "autotune-trial",
        "--run-dir",
        "d",
        "--memory-limit-mb",
        "900",
        "--",
    ]


def test_a_run_config_written_before_autotune_trains_as_a_run():
    """run.yaml files rendered before train.autotune_trial existed lack the key: the dataclass's
    default must be a run's (evaluate, save), not a trial's."""
    from gptflow.config.settings import TrainConfig

    assert TrainConfig(train_iters=10).autotune_trial is False
