"""The workflow on a real Slurm cluster: tests/slurm/start-cluster.sh starts one (slurmctld,
slurmd, slurmdbd, munge, MariaDB from Debian's packages) on 127.0.0.1, and every rule goes
through sbatch via the Snakemake Slurm plugin and tests/slurm/profile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from .conftest import BIN, REPO

START = REPO / "tests" / "slurm" / "start-cluster.sh"
PROFILE = REPO / "tests" / "slurm" / "profile"


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip(
            "the local Slurm cluster needs root: it installs Debian packages and starts daemons"
        )
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("the local Slurm cluster needs Debian's slurm-wlm packages (apt-get not found)")
    out = subprocess.run(
        ["bash", str(START)], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


def slurm_snakemake(workdir, configfile, *args, timeout=900):
    """Snakemake through the Slurm profile, under a hard timeout: the plugin can wait forever
    when its status queries fail (reference/local-slurm-cluster.md)."""
    cmd = [
        "timeout", "-k", "30", str(timeout),
        str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir), "--profile", str(PROFILE), "--configfile", str(configfile),
        *args,
    ]  # fmt: skip
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def sacct_states(workdir) -> dict[str, list[str]]:
    """Slurm's accounting (sacct) of every job the plugin submitted, by rule: the job ids come
    from the plugin's per-rule log directories (.snakemake/slurm_logs/rule_X/[WILDCARDS/]JOBID.log)."""
    root = workdir / ".snakemake" / "slurm_logs"
    ids = {
        log.stem: log.relative_to(root).parts[0].removeprefix("rule_")
        for log in root.glob("rule_*/**/*.log")
    }
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "--format=JobID,State", "-j", ",".join(ids)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    states: dict[str, list[str]] = {}
    for line in out.splitlines():
        job, state = line.split("|")
        states.setdefault(ids[job], []).append(state)
    return states


def test_the_tiny_pipeline_runs_through_sbatch_with_two_training_ranks(
    slurm_cluster, tmp_path, tiny_config
):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config, sort_keys=False))
    run = slurm_snakemake(tmp_path, config)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    done = json.loads((tmp_path / "results/runs/tiny/DONE.json").read_text())
    assert done["final_step"] == tiny_config["train"]["train_iters"]
    log = (tmp_path / "logs/train_gpt/tiny.log").read_text()
    assert "2 ranks (slurm)" in log
    states = sacct_states(tmp_path)
    for rule in (
        "collect_local_documents",
        "sample_documents",
        "train_tokenizer",
        "tokenize_shard",
        "render_run_config",
        "build_data_index",
        "train_gpt",
    ):
        assert states.get(rule) and set(states[rule]) == {"COMPLETED"}, (rule, states)
