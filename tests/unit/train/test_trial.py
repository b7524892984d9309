"""`gptflow autotune-trial` (gptflow.train.trial.run_trial) around real child processes: a run
that ran out of memory (a rank's record) becomes the trial's DONE.json and exit 0; any other
failure stays the child's exit code; an earlier attempt's record does not count; the memory
limit reaches the child; a signal reaches it. And PyTorch's own CPU allocator refusing an
allocation under that limit is recognised as running out of memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from gptflow.train import trial

PY = sys.executable


def child(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def oom_record(rank: int) -> str:
    """A rank's record, written as the trainer writes it."""
    return textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from gptflow.train.trial import record_out_of_memory
        print(record_out_of_memory(Path(sys.argv[1]), {rank}, MemoryError("no room")))
    """)


def test_a_run_out_of_memory_is_a_trial_done_and_exit_0(tmp_path, capfd):
    run_dir = tmp_path / "r.tune.mb8.z0.ac0"
    code = f"""
        import subprocess, sys
        for code in ({oom_record(1)!r}, {oom_record(0)!r}):
            subprocess.run([sys.executable, "-c", code, sys.argv[1]], check=True)
        sys.exit(1)
    """
    cmd = [PY, "-c", textwrap.dedent(code), str(run_dir)]
    assert trial.run_trial(run_dir, cmd, memory_limit_mb=None) == 0
    done = json.loads((run_dir / "DONE.json").read_text())
    assert done["run"] == "r.tune.mb8.z0.ac0"
    assert done["trial"] == {"status": "out_of_memory", "ranks": [0, 1], "message": "no room",
                             "exit_code": 1, "memory_limit_mb": None}  # fmt: skip
    assert trial.trial_done(run_dir)["status"] == "out_of_memory"
    out = capfd.readouterr().out
    assert "rank 0 ran out of memory (MemoryError: no room)" in out
    assert "r.tune.mb8.z0.ac0 ran out of memory on rank(s) 0, 1 (no room)" in out


def test_any_other_failure_stays_a_failure(tmp_path):
    run_dir = tmp_path / "r"
    assert trial.run_trial(run_dir, child("import sys; sys.exit(3)")) == 3
    assert trial.run_trial(run_dir, child("import sys; sys.exit(75)")) == 75  # preempted
    assert not (run_dir / "DONE.json").exists()


def test_an_earlier_attempts_record_does_not_count(tmp_path):
    run_dir = tmp_path / "r"
    subprocess.run([PY, "-c", oom_record(0), str(run_dir)], check=True)
    assert list((run_dir / "out_of_memory").iterdir())
    assert trial.run_trial(run_dir, child("import sys; sys.exit(1)")) == 1
    assert not (run_dir / "DONE.json").exists()


def test_a_finished_trial_is_left_as_the_trainer_wrote_it(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    write = "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'trial': {'status': 'measured'}}))"
    assert trial.run_trial(run_dir, [PY, "-c", write, str(run_dir / "DONE.json")]) == 0
    assert trial.trial_done(run_dir) == {"status": "measured"}


def test_the_memory_limit_reaches_the_child(tmp_path):
    out = tmp_path / "limit"
    code = f"import resource; open({str(out)!r}, 'w').write(str(resource.getrlimit(resource.RLIMIT_DATA)))"
    assert trial.run_trial(tmp_path / "r", child(code), memory_limit_mb=3000) == 0
    assert out.read_text() == str((3000 * 2**20, 3000 * 2**20))


def test_a_signal_to_the_trial_reaches_its_command(tmp_path):
    """What Snakemake's cancel (SIGTERM) and Slurm's warning (SIGUSR1) do to a trial's job."""
    got = tmp_path / "got"
    code = f"""
        import signal, sys, time
        def on(signum, frame):
            open({str(got)!r}, "w").write(str(signum))
            sys.exit(75)
        signal.signal(signal.SIGUSR1, on)
        open({str(got)!r} + ".ready", "w").close()
        time.sleep(60)
    """
    script = (f"import sys; from gptflow.train.trial import run_trial; "
              f"sys.exit(run_trial({str(tmp_path / 'r')!r}, {child(code)!r}))")  # fmt: skip
    proc = subprocess.Popen([PY, "-c", script])
    deadline = time.time() + 30
    while not os.path.exists(f"{got}.ready") and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 75
    assert got.read_text() == str(int(signal.SIGUSR1))


def test_pytorchs_cpu_allocator_refusing_is_out_of_memory():
    """A real refusal: 2 GB asked of a process limited to 1.5 GB of data (after torch's own)."""
    code = """
        import resource, torch
        from gptflow.train.trial import is_out_of_memory
        resource.setrlimit(resource.RLIMIT_DATA, (1500 * 2**20, 1500 * 2**20))
        try:
            torch.empty(2 * 10**9, dtype=torch.uint8)
        except Exception as e:
            print(type(e).__name__, is_out_of_memory(e))
    """
    out = subprocess.run(child(code), capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "True", out
    assert trial.is_out_of_memory(MemoryError())
    assert not trial.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not trial.is_out_of_memory(ValueError("DefaultCPUAllocator: not enough memory"))


def test_the_command_line_takes_the_command_after_double_dash(tmp_path, capsys):
    from gptflow.cli import main

    assert main(["autotune-trial", "--run-dir", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err == (
        "gptflow autotune-trial: error: no command after --: give the trial's launcher and "
        "gptflow train\n"
    )
    out = tmp_path / "ran"
    code = ["autotune-trial", "--run-dir", str(tmp_path / "r"), "--memory-limit-mb", "3000",
            "--", PY, "-c", f"import resource; open({str(out)!r}, 'w').write("
            "str(resource.getrlimit(resource.RLIMIT_DATA)[0]))"]  # fmt: skip
    assert main(code) == 0 and out.read_text() == str(3000 * 2**20)  # the limit reached it
