"""A run continued in another layout: more or fewer ranks, another ZeRO stage. The saved step
is converted once to DeepSpeed's universal checkpoint and the run goes on from it -- never
from step 0 -- with the losses of the run that kept its layout (fp32, within 1e-4: the data
order and the dropout masks do not depend on the number of ranks)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.in_turn import copy_run

from .test_train import BIN, gptflow_train, records

SETTINGS = dict(train_iters=8, log_interval=1, eval_iters=1, eval_interval=8, global_batch_size=8)


def torchrun(run_dir, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "gptflow",
        "train", "--config", str(run_dir / "run.yaml"), "--threads", "1", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def stopped_at_4(proc: subprocess.CompletedProcess) -> bool:
    """torchrun exits 1 when its workers exit 75 (saved and stopped); it reports their code."""
    return proc.returncode == 1 and "exitcode  : 75" in proc.stderr


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def continue_with(run_dir, **train) -> None:
    """Edit the run's run.yaml the way a changed config would (same series: the layout is not
    part of the trajectory's fingerprint)."""
    import yaml

    path = run_dir / "run.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["train"].update(train)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def assert_continues(straight: dict, moved: dict) -> None:
    assert sorted(moved) == sorted(straight) == list(range(1, 9))
    assert max(abs(straight[s] - moved[s]) for s in straight) < 1e-4, (straight, moved)


def test_two_ranks_continue_on_one_and_zero1_continues_at_zero2(make_run, tmp_path):
    """The run stopped at step 4 continues twice, from two copies: on one rank, and on two at
    ZeRO 2."""
    straight = make_run("straight", zero_stage=1, **SETTINGS)
    assert torchrun(straight).returncode == 0
    want = losses(straight)

    moved = make_run("moved", zero_stage=1, **SETTINGS)
    first = torchrun(moved, "--exit-interval", "4")
    assert stopped_at_4(first), first.stderr[-3000:]
    restaged = copy_run(moved, tmp_path / "restaged")
    second = gptflow_train(moved)  # one rank now
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from step 4" in second.stderr
    assert "loading it through DeepSpeed's universal checkpoint" in second.stderr
    (series,) = (moved / "checkpoints").iterdir()
    assert (series / "step00000004" / "universal" / "zero").is_dir()
    assert not list((series / "step00000004").glob(".universal.*.tmp"))  # fsutil temp names
    done = json.loads((series / "step00000008" / "COMPLETE").read_text())
    assert done["layout"] == {
        "world_size": 1, "zero_stage": 1, "precision": "fp32", "tensor_parallel": 1,
        "pipeline_parallel": 1, "optimizer": "adamw",
    }  # fmt: skip
    assert_continues(want, losses(moved))

    continue_with(restaged, zero_stage=2)
    again = torchrun(restaged)  # two ranks, ZeRO 2
    assert again.returncode == 0, again.stderr[-3000:]
    assert "universal checkpoint" in again.stderr
    assert_continues(want, losses(restaged))


def test_a_zero0_checkpoint_refuses_zero1_with_the_way_on(make_run):
    run_dir = make_run("zero0", zero_stage=0, **SETTINGS)
    assert gptflow_train(run_dir, "--exit-interval", "2").returncode == 75
    continue_with(run_dir, zero_stage=1)
    refused = gptflow_train(run_dir)
    assert refused.returncode == 1
    assert (
        "saved at ZeRO stage 0 on 1 ranks (tensor parallel 1), now ZeRO stage 1 on 1 ranks "
        "(tensor parallel 1)" in refused.stderr
    )
    assert "Set train.zero_stage 0 and train.tensor_parallel 1 to continue" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_which_layout_changes_load_how(tmp_path):
    from gptflow.errors import GptflowError
    from gptflow.train.checkpoint import resume_mode

    def layout(world, zero, tp=1, pp=1, optimizer="adamw"):
        return {"world_size": world, "zero_stage": zero, "precision": "fp32",
                "tensor_parallel": tp, "pipeline_parallel": pp, "optimizer": optimizer}  # fmt: skip

    assert resume_mode(None, layout(2, 1), tmp_path) == "native"  # no layout recorded
    assert resume_mode(layout(4, 0), layout(1, 0), tmp_path) == "native"  # whole states
    assert resume_mode(layout(2, 1), layout(2, 1), tmp_path) == "native"
    assert resume_mode(layout(2, 3), layout(2, 3), tmp_path) == "native"
    assert resume_mode(layout(2, 1), layout(1, 1), tmp_path) == "universal"
    assert resume_mode(layout(8, 2), layout(16, 1), tmp_path) == "universal"
    assert resume_mode(layout(4, 0, tp=2), layout(2, 0, tp=2), tmp_path) == "native"
    assert resume_mode(layout(4, 1, tp=2), layout(4, 1, tp=2), tmp_path) == "native"
    assert resume_mode(layout(2, 1, tp=2), layout(1, 1), tmp_path) == "universal"
    assert resume_mode(layout(2, 2), layout(4, 1, tp=4), tmp_path) == "universal"
    assert resume_mode(layout(4, 1, pp=2), layout(4, 1, pp=2), tmp_path) == "native"
    assert resume_mode(layout(2, 1, pp=2), layout(1, 1), tmp_path) == "universal"
    assert resume_mode(layout(2, 2), layout(4, 1, pp=4), tmp_path) == "universal"
    # the same ranks and ZeRO stage, the model split another way: every rank's slices differ
    # (pipeline parallel runs at ZeRO 1 only: TrainConfig)
    for saved, now in [
        (layout(4, 1, pp=2), layout(4, 1)),  # pipeline only
        (layout(4, 1), layout(4, 1, pp=4)),
        (layout(4, 1, tp=2), layout(4, 1, pp=2)),  # tensor <-> pipeline
        *[(layout(4, z, tp=2), layout(4, z)) for z in (1, 2)],  # tensor only
        *[(layout(4, z, tp=2), layout(4, z, tp=4)) for z in (1, 2)],
    ]:
        assert resume_mode(saved, now, tmp_path) == "universal", (saved, now)
    for saved, now, message in [
        (layout(2, 1), layout(2, 0), "Set train.zero_stage 1 and train.tensor_parallel 1"),
        (layout(1, 0), layout(1, 2), "Set train.zero_stage 0 and train.tensor_parallel 1"),
        (layout(2, 0, tp=2), layout(2, 0), "Set train.zero_stage 0 and train.tensor_parallel 2"),
        (layout(2, 3), layout(1, 3), "Continue at ZeRO stage 3 on 2 ranks"),
        (layout(2, 1), layout(2, 3), "Continue at ZeRO stage 1 on 2 ranks"),
    ]:
        with pytest.raises(GptflowError, match=message):
            resume_mode(saved, now, tmp_path)
    # Muon's momentum is not in a universal checkpoint: its runs stay in their layout
    muon = functools.partial(layout, optimizer="muon")
    assert resume_mode(layout(2, 1), muon(2, 1), tmp_path) == "native"
    assert resume_mode(layout(4, 0), muon(1, 0), tmp_path) == "native"
    for saved in (muon(2, 1), layout(2, 1)):  # saved before the optimizer was recorded too
        with pytest.raises(
            GptflowError, match=r"not Muon's momentum .* Continue at ZeRO stage 1 on 2"
        ):
            resume_mode(saved, muon(1, 1), tmp_path)


def test_a_checkpoints_layout_records_the_optimizer_that_decides_how_it_moves():
    """The trainer asks resume_mode with layout_of's record, which carries the run's optimizer:
    without it a Muon run moved to another ZeRO stage reached DeepSpeed's universal conversion
    and died there (KeyError: 'exp_avg', measured) instead of the one line with the way on."""
    from gptflow.config.settings import TrainConfig
    from gptflow.errors import GptflowError
    from gptflow.train.checkpoint import resume_mode
    from gptflow.train.loop import layout_of

    muon = TrainConfig(train_iters=10, optimizer="muon", clip_grad=0.0, zero_stage=2)
    assert layout_of(muon, 2)["optimizer"] == "muon"
    saved = layout_of(dataclasses.replace(muon, zero_stage=1), 2)
    with pytest.raises(GptflowError, match="cannot move layouts"):
        resume_mode(saved, layout_of(muon, 2), Path("step00000002"))
    adamw = dataclasses.replace(muon, optimizer="adamw")
    assert (
        resume_mode(saved | {"optimizer": "adamw"}, layout_of(adamw, 2), Path(".")) == "universal"
    )
