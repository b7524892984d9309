"""DONE.json's ``checkpoint_sha256``: identical runs record the same digest, another
hyperparameter another one, and the digest of a step outlives what is derived from it later
inside its directory (DeepSpeed's universal conversion)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from gptflow.train.checkpoint import checkpoint_digest
from tests.support.in_turn import train_in_turn

from .test_train import BIN, directory_digest, gptflow_train

SETTINGS = dict(
    train_iters=6, log_interval=3, eval_interval=6, eval_iters=1, save_interval=100, zero_stage=1
)


def done(run_dir: Path) -> dict:
    return json.loads((run_dir / "DONE.json").read_text())


def test_identical_runs_record_the_same_digest_and_another_lr_another(make_run):
    """Two identical one-rank runs in different directories, one of them finished again on two
    ranks (Snakemake reruns a finished train job when a setting outside the trajectory
    changes; the rerun resumes the final step in the new layout through DeepSpeed's universal
    conversion, written into the step directory, and trains nothing): all record one digest.
    Before, the conversion left DeepSpeed's `latest_universal` in the step, naming the
    conversion's temporary directory (host, pid, random), and the digest hashed it and
    `universal/`. One hyperparameter changed (train.lr) records another digest."""
    a, b = make_run("a", **SETTINGS), make_run("b", **SETTINGS)
    other = make_run("other", **{**SETTINGS, "lr": 2.0e-3})
    # a and b in processes of their own (a digest must not depend on the process that saved);
    # other after a, in a's (tests/support/in_turn.py)
    rec = train_in_turn([(a, None), (other, None)], 1, a.parent / "rec")
    assert [rec[r.name][0]["code"] for r in (a, other)] == [0, 0]
    out = gptflow_train(b)
    assert out.returncode == 0, out.stderr[-3000:]
    digest = done(a)["checkpoint_sha256"]
    assert done(b)["checkpoint_sha256"] == digest
    assert done(other)["checkpoint_sha256"] != digest
    assert directory_digest(Path(done(a)["checkpoint"])) == digest  # no subdirectory yet

    (b / "DONE.json").unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "gptflow",
        "train", "--config", str(b / "run.yaml"), "--threads", "1",
    ]  # fmt: skip
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "through DeepSpeed's universal checkpoint" in rerun.stderr
    step = Path(done(b)["checkpoint"])
    assert sorted(p.name for p in step.iterdir()) == [
        "COMPLETE", "mp_rank_00_model_states.pt", "universal",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]  # fmt: skip
    assert done(b)["final_step"] == 6
    assert done(b)["checkpoint_sha256"] == checkpoint_digest(step) == digest
