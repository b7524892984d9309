"""The workflow through profiles/pbs (Snakemake's generic cluster executor: qsub, status.py over
qstat, qdel) on the test cluster's Torque-syntax commands: Debian's slurm-wlm-torque, Slurm's
own qsub/qstat/qdel wrappers in front of the one-node Slurm cluster of tests/slurm. Not a real
PBS Pro or Torque server: the wrappers turn qsub into sbatch, and no job gets a $PBS_NODEFILE
(test_a_launch_from_a_one_node_pbs_nodefile gives one to the launch itself)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess

import yaml

from tests.support.hub import Hub

from .conftest import BIN, REPO, job_counts

PROFILE = REPO / "profiles" / "pbs"
PBS_PAGE = REPO / "docs" / "pbs.md"  # its quick start names the Torque edit
ENV = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}


def pbs_snakemake(workdir, config, *args, timeout=600, env=None, profile=PROFILE):
    cmd = [
        "timeout", "-k", "30", str(timeout), str(BIN / "snakemake"),
        "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
        "--profile", str(profile), "--configfile", str(config), *args,
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env or ENV)
    out.out = out.stdout + out.stderr
    return out


def write(path, cfg):
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_the_pbs_profile_plans_mpiexec_per_node_and_refuses_its_placeholders(tmp_path, tiny_config):
    """Unedited, the plan names every placeholder and a real run submits nothing. With 2 nodes
    of 2 ranks, train_gpt is one `gptflow train --nproc-per-node 2 --nnodes 2` per node under
    `mpiexec -n 2 --ppn 1`, and the preflight checks the config against the 4 ranks and
    their GPUs' memory, and names the PBS commands that find the profile's values."""
    cfg = {**tiny_config, "train": {**tiny_config["train"], "micro_batch_size": 2}}
    config = write(tmp_path / "config.yaml", cfg)
    two_nodes = ["--set-resources", "train_gpt:nodes=2", "train_gpt:tasks_per_node=2",
                 "train_gpt:mpi=mpiexec", "train_gpt:pbs_select='select=2:system=polaris'"]  # fmt: skip
    plan = pbs_snakemake(tmp_path, config, "-n", "-p", *two_nodes, timeout=120)
    assert plan.returncode == 0, plan.out[-4000:]
    for key in ("pbs_account is <account>", "pbs_queue is <cpu queue>",
                "pbs_select is <resource line>", "pbs_filesystems is <filesystems>"):  # fmt: skip
        assert f"default-resources {key}" in plan.out, plan.out[-4000:]
    assert "train_gpt on 2 node(s) x 2 rank(s) = 4 data parallel" in plan.out
    # the PBS profile's own hint, and its GPU nodes get the memory fit check
    assert "gptflow: edit the PBS profile first:" in plan.out and "`qstat -Q`" in plan.out
    assert "memory per GPU" in plan.out, plan.out[-4000:]
    assert re.search(
        r"^Shell command: mpiexec -n 2 --ppn 1 gptflow train --config results/runs/tiny/run.yaml "
        r"--nproc-per-node 2 --nnodes 2 --threads \d+ --wait-for-lock",
        plan.out, re.M,
    ), plan.out[-4000:]  # fmt: skip
    run = pbs_snakemake(tmp_path, config, *two_nodes, timeout=120)
    assert run.returncode != 0
    assert "gptflow: not submitted: edit the profile first" in run.out, run.out[-4000:]
    assert not (tmp_path / ".snakemake" / "pbs_logs").exists()  # nothing went to qsub


def readme_torque_edit(profile_text: str) -> str:
    """docs/pbs.md's Torque edit of profiles/pbs/config.yaml, applied as written: the sentence
    of its quick start that begins "On Torque", each code span in it that starts with ','
    deleted from the submit line ('…' standing for the rest of that resource) and each that
    ends with ':' a line deleted from the profile (the other spans name where)."""
    section = PBS_PAGE.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"On Torque,[^.]*\.", " ".join(section.split()))
    assert match, "docs/pbs.md's quick start has no Torque edit"
    text = profile_text
    for span in re.findall(r"`([^`]+)`", match.group()):
        if span.startswith(","):
            pattern = r"[^,\s]*".join(re.escape(part) for part in span.split("…"))
            lines = text.splitlines(keepends=True)  # the submit line, not the comments
            cut = [line if line.lstrip().startswith("#") else re.sub(pattern, "", line)
                   for line in lines]  # fmt: skip
            assert sum(a != b for a, b in zip(lines, cut, strict=True)) == 1, span
            text = "".join(cut)
        elif span.endswith(":"):
            text, n = re.subn(rf"(?m)^[ \t]*{re.escape(span)}.*\n", "", text)
            assert n == 1, (span, n)
    return text


def test_the_readmes_torque_edit_plans_without_a_placeholder(tmp_path, tiny_config):
    """profiles/pbs edited for Torque as docs/pbs.md says (extracted from the page, applied
    to a copy), every other placeholder filled: the plan names no placeholder, so a real run
    submits (gptflow.plan.placement.placeholders decides both), and the submit line still names
    only resources the profile gives and no filesystems (a Torque qsub refuses one)."""
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "status.py").symlink_to(PROFILE / "status.py")
    text = readme_torque_edit((PROFILE / "config.yaml").read_text())
    values = {"pbs_account": "proj", "pbs_queue": "batch", "pbs_select": "nodes=1:ppn=8"}
    text = re.sub(  # a Torque user has no value for anything else
        r'(?m)^([ \t]*)(pbs_\w+): "<[^>]*>"',
        lambda m: f"{m[1]}{m[2]}: {values[m[2]]}" if m[2] in values else m[0],
        text,
    )
    (profile / "config.yaml").write_text(text)
    edited = yaml.safe_load(text)
    submit = edited["cluster-generic-submit-cmd"]
    assert "filesystems" not in submit
    assert set(re.findall(r"\{resources\.(\w+)\}", submit)) <= set(edited["default-resources"])

    cfg = {**tiny_config, "train": {**tiny_config["train"], "micro_batch_size": 2}}  # 4 ranks
    plan = pbs_snakemake(tmp_path, write(tmp_path / "config.yaml", cfg), "-n", profile=profile)
    assert plan.returncode == 0, plan.out[-4000:]
    assert "train_gpt on 1 node(s) x 4 rank(s)" in plan.out, plan.out[-4000:]
    assert "edit the PBS profile first" not in plan.out, plan.out[-4000:]


def test_the_tiny_pipeline_runs_through_qsub(slurm_cluster, tmp_path, tiny_config):
    """Every job through the profile's qsub line (PBS Pro's select=1:system=... for the CPU
    jobs, Torque's nodes=1:ppn=2 for training), polled by its status.py over qstat; training
    is 2 gloo ranks on the node, started by `gptflow train --nproc-per-node 2 --nnodes 1`."""
    config = write(tmp_path / "config.yaml", tiny_config)
    cli = [
        "--default-resources", "pbs_account=default", "pbs_queue=debug", "runtime=10",
        "pbs_select='select=1:system=test'", "pbs_filesystems='home:eagle'", "mem_mb=1000",
        "disk_mb=1000",
        "--set-resources", "train_gpt:nodes=1", "train_gpt:tasks_per_node=2",
        "train_gpt:mpi=mpiexec", "train_gpt:pbs_select='nodes=1:ppn=2'",
        "--set-threads", "train_gpt=1", "--seconds-between-status-checks", "1", "--jobs", "4",
        "--latency-wait", "10",
    ]  # fmt: skip
    run = pbs_snakemake(tmp_path, config, *cli, timeout=900)
    assert run.returncode == 0, run.out[-6000:]
    done = json.loads((tmp_path / "results/runs/tiny/DONE.json").read_text())
    assert done["final_step"] == tiny_config["train"]["train_iters"]
    assert "2 ranks (torchrun)" in (tmp_path / "logs/train_gpt/tiny.log").read_text()
    ids = [line.split("'")[1] for line in run.out.splitlines() if "with external jobid" in line]
    logs = {p.name.split("-")[0] for p in (tmp_path / ".snakemake/pbs_logs").glob("*.log")}
    assert {"train_gpt", "evaluate", "tokenize_shard", "export_hf"} <= logs, logs
    assert len(ids) == len(list((tmp_path / ".snakemake/pbs_logs").glob("*.log"))) >= 8
    # Slurm's own record of what the wrappers submitted: our job names, all completed
    acct = subprocess.run(
        ["sacct", "-X", "-n", "-P", "--format=JobID,JobName,State,NNodes,NCPUS", "-j", ",".join(ids)],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    rows = [line.split("|") for line in acct]
    assert len(rows) == len(ids) and {r[2] for r in rows} == {"COMPLETED"}, acct
    (train,) = [r for r in rows if r[1] == "gptflow_train_gpt"]
    assert train[3:] == ["1", "2"], train  # nodes=1:ppn=2 -> 1 node, 2 CPUs


def test_a_launch_from_a_one_node_pbs_nodefile(make_run, tmp_path):
    """Inside a PBS job: $PBS_NODEFILE lists this host once per rank; `gptflow train
    --nproc-per-node 2 --nnodes 1` rendezvouses (c10d) at its first host and trains 2 gloo
    ranks. A node file of 2 hosts under --nnodes 1 is one clear line, before any rank starts."""
    run_dir = make_run("pbs", train_iters=6)
    nodefile = tmp_path / "nodefile"
    host = socket.gethostname()
    nodefile.write_text(f"{host}\n{host}\n")
    env = {**os.environ, "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "4242.pbs-server",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [str(BIN / "gptflow"), "train", "--config", str(run_dir / "run.yaml"),
           "--nproc-per-node", "2", "--nnodes", "1", "--threads", "1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 ranks (torchrun)" in out.stderr
    assert json.loads((run_dir / "DONE.json").read_text())["final_step"] == 6

    nodefile.write_text(f"{host}\nother-node\n")
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode != 0
    assert (
        f"--nnodes 1 (set-resources train_gpt nodes), but PBS_NODEFILE {nodefile} lists 2 node(s)"
    ) in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr


def test_the_hf_trainer_example_plans_through_the_pbs_profile(tmp_path):
    """config/examples/hf-trainer-wikitext.yaml, llm-pytorch's recipe (WikiText-2 raw by its Hub
    name, a gpt-neo-125m-sized GPT-NeoX, fp16, K-FAC, a checkpoint every 1000 steps), planned
    through profiles/pbs on 2 nodes x 4 GPUs as its users run it: one collect_hf_documents job,
    GPT-2's vocab and merges downloaded and converted, training under `mpiexec -n 2 --ppn 1`,
    K-FAC's memory in the fit check. Online planning asks the Hub once whether the dataset
    exists (the dataset itself is read by its job), so the test's HF_HUB_OFFLINE is dropped
    and HF_ENDPOINT points at a loopback Hub: no network is touched."""
    example = REPO / "config" / "examples" / "hf-trainer-wikitext.yaml"
    hub = Hub({"Salesforce/wikitext": []})
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_ENDPOINT"] = hub.url
    # (--set-resources replaces the profile's train_gpt entry whole: mpi given again)
    nodes = ["--set-resources", "train_gpt:nodes=2", "train_gpt:tasks_per_node=4",
             "train_gpt:mpi=mpiexec", "train_gpt:pbs_select='select=2:system=polaris'"]  # fmt: skip
    plan = pbs_snakemake(tmp_path, example, "--replace-workflow-config", "-n", "-p", *nodes,
                         timeout=120, env=env)  # fmt: skip
    assert plan.returncode == 0, plan.out[-4000:]
    counts = job_counts(plan.out)
    for rule, n in (("collect_hf_documents", 1), ("download_tokenizer_file", 2),
                    ("convert_gpt2_tokenizer", 1), ("tokenize_shard", 1), ("train_gpt", 1)):  # fmt: skip
        assert counts.get(rule) == n, (rule, counts)
    assert "train_gpt on 2 node(s) x 4 rank(s) = 8 data parallel; micro batch 8 x grad accum 1" in (
        plan.out
    )
    assert re.search(r"memory per GPU: .*K-FAC factors 3\.6 GiB", plan.out), plan.out[-4000:]
    assert re.search(r"^Shell command: mpiexec -n 2 --ppn 1 gptflow train ", plan.out, re.M)
    assert not (tmp_path / "results").exists() and not (tmp_path / "resources").exists()
    hub.close()
    assert hub.asked == ["/api/datasets/Salesforce/wikitext"]
    assert "could not ask the Hub" not in plan.out
