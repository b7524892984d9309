"""A checkpoint that cannot be written stops training with one clear error, saved in the
background (train.async_save true, the default with GPUs) or synchronously.

The trainer runs under a file-size limit (RLIMIT_FSIZE) that the run's small files (run
config, metrics, COMPLETE) stay under and a checkpoint's model file does not: the write fails
with EFBIG (Python ignores SIGXFSZ), as on a full disk, from the kernel, not from a mock.
"""

from __future__ import annotations

import resource

import pytest

from .test_train import gptflow_train, records

LIMIT = 200_000  # bytes: the tiny model's mp_rank_00_model_states.pt is ~2 MB


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_checkpoint_that_cannot_be_written_is_one_error_and_nothing_complete(
    make_run, async_save
):
    run_dir = make_run(
        "full", train_iters=6, log_interval=1, eval_iters=0, save_interval=1,
        async_save=async_save,
    )  # fmt: skip
    out = gptflow_train(run_dir, preexec_fn=limited)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("gptflow train: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    (error,) = errors
    (series,) = (run_dir / "checkpoints").iterdir()
    model_file = series / "step00000001" / "mp_rank_00_model_states.pt"
    assert f"{model_file}" in error, error
    # torch's zip writer reports a failed write as "basic_ios::clear: iostream error" (no
    # errno): the file and the size are what the error can name
    if not async_save:
        assert f"{model_file}: writing this checkpoint file failed: " in error, error
    else:
        assert "checkpoint step 1: rank 0 could not write its files" in error, error
        assert "no checkpoint is complete yet" in error and "set train.async_save false" in error
    # nothing looks like a checkpoint: no COMPLETE, no latest, no model file under its name
    assert not (series / "latest").exists()
    assert not list(series.glob("step*/COMPLETE"))
    if async_save:  # written under its own name in a hidden directory, renamed when whole
        visible = [p for p in series.rglob("*.pt") if not any(
            part.startswith(".") for part in p.relative_to(series).parts)]  # fmt: skip
        assert visible == [], visible
        assert not list(series.glob("step*/.writing-rank*"))
    else:  # torch.save writes in place: the step's debris, cleared by the next save of it
        assert model_file.is_file() and model_file.stat().st_size <= LIMIT
    # the failed save of step 1 stops training at the next step at the latest
    assert [r["step"] for r in records(run_dir, "train")] in ([1], [1, 2])
    assert not (run_dir / "DONE.json").exists()
