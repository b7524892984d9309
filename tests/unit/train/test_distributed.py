"""Rank, world size and master address from srun, torchrun, or a plain process."""

import re
from pathlib import Path

import pytest

from gptflow.errors import GptflowError
from gptflow.train.distributed import first_host, parse_first_host, resolve


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node001", "node001"),
        ("gpu[07-09,12]", "gpu07"),
        ("gpu[12,07-09]", "gpu12"),
        ("a100-[3-4],cpu1", "a100-3"),
        ("n1,n2", "n1"),
        ("rack[1-2]-n[01-04]", "rack1-n01"),  # every bracket group, not only the first
        ("rack[3]-gpu[10-11],rack4-gpu01", "rack3-gpu10"),
    ],
)
def test_parse_first_host(nodelist, host):
    assert parse_first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "gpu[07", ",n1"])
def test_a_node_list_that_is_none_is_named(nodelist):
    with pytest.raises(GptflowError, match="is not a Slurm node list"):
        parse_first_host(nodelist)


def fake_scontrol(bin_dir, out: str, code: int = 0):
    """A stand-in `scontrol` that records its arguments and prints `out`: Slurm's own
    expansion is tested with the real one in tests/workflow/test_slurm.py's jobs (whose
    ranks find rank 0 through it); here it shows which of the two answers is used."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" > {bin_dir}/args\nprintf "{out}"\nexit {code}\n')
    script.chmod(0o755)


def test_first_host_is_the_first_that_scontrol_show_hostnames_prints(tmp_path, monkeypatch):
    """scontrol on PATH: its expansion wins (here a host the parser could not guess); when
    it fails, or is not on PATH, the parser answers."""
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    fake_scontrol(tmp_path / "bin", "node-b\\nnode-a\\n")
    assert first_host("gpu[07-09]") == "node-b"
    assert (tmp_path / "bin/args").read_text() == "show hostnames gpu[07-09]\n"
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
           "SLURM_STEP_NODELIST": "gpu[07-08]"}  # fmt: skip
    assert resolve(env).master_addr == "node-b"
    fake_scontrol(tmp_path / "bin", "", code=1)
    assert first_host("gpu[07-09]") == "gpu07"
    (tmp_path / "bin/scontrol").unlink()
    assert first_host("rack[1-2]-n[01-04]") == "rack1-n01"


def test_srun_task_of_a_two_node_job():
    env = {
        "SLURM_PROCID": "11",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "3",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
    }
    d = resolve(env)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size) == (11, 16, 3, 8)
    assert d.master_addr == "gpu07" and d.launcher == "slurm"
    assert d.master_port == 10000 + 123456 % 20000  # the same on every task of the job


def test_torchrun_wins_and_single_process_default():
    d = resolve(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1234",
        }
    )
    assert (d.rank, d.world_size, d.master_addr, d.master_port, d.launcher) == (
        1,
        2,
        "h",
        1234,
        "torchrun",
    )
    d = resolve({})
    assert (d.rank, d.world_size, d.launcher) == (0, 1, "single") and d.master_port is None


def test_bad_values_are_named():
    with pytest.raises(GptflowError, match=r"SLURM_PROCID='x' is not an integer"):
        resolve({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"})


def test_srun_line_for_two_nodes_of_eight_gpus():
    """What the train_gpt rule runs under profiles/slurm (nodes 2, tasks_per_node 8): every
    count explicit, because Snakemake's jobstep strips SLURM_NTASKS and friends."""
    from gptflow.train.distributed import srun_command

    line = srun_command("srun", nodes=2, tasks_per_node=8, cpus_per_task=12)
    assert line == [
        "srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=8", "--cpus-per-task=12"
    ]  # fmt: skip
    from gptflow.container.image import container_launch

    opts, prefix = container_launch(
        "sqsh", "/shared/gptflow-abc.sqsh", "/shared/work", ["/data:/data:ro"], srun=True
    )
    pyxis = srun_command("srun", nodes=2, tasks_per_node=8, container_options=opts)
    assert prefix == []
    assert pyxis[3:] == [
        "--ntasks-per-node=8",
        "--container-image=/shared/gptflow-abc.sqsh",
        "--container-mounts=/shared/work:/shared/work,/data:/data:ro",
        "--container-workdir=/shared/work",
        "--no-container-mount-home",
    ]
    assert srun_command("srun", tasks=2) == ["srun", "--kill-on-bad-exit=1", "--ntasks=2"]
    assert srun_command("") == []  # one machine: no launcher


def test_the_shipped_config_plans_on_the_shipped_slurm_profile(repo, tmp_path):
    """snakemake -n with config/config.yaml and profiles/slurm as shipped, on a machine without
    Slurm (no sbatch, sinfo, sacct on PATH): the two agree (8 ranks x micro batch 2 = the
    global batch of 16), the placeholders are named first, train_gpt asks for 1 node x 8 tasks
    with gres gpu:8 per node (not gpu=, which implies --ntasks-per-gpu), each rank's CPUs are
    its torch threads, and its shell starts 8 ranks."""
    import os
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    shutil.copy(repo / "config/config.yaml", tmp_path / "c.yaml")
    # a PATH of everything this machine has except Slurm's commands
    slurm = re.compile(
        r"s(batch|alloc|attach|bcast|cancel|control|diag|info|prio|queue|report|share|stat"
        r"|trigger|view|acct|acctmgr|run|crontab|h5util)|slurm.*|munge.*"
    )
    no_slurm = tmp_path / "bin"
    no_slurm.mkdir()
    for d in [str(Path(sys.executable).parent), *os.environ["PATH"].split(os.pathsep)]:
        for exe in Path(d).glob("*") if Path(d).is_dir() else ():
            link = no_slurm / exe.name
            if not slurm.fullmatch(exe.name) and not link.exists() and os.access(exe, os.X_OK):
                link.symlink_to(exe)
    for tool in ("sbatch", "sinfo", "sacct", "squeue", "scontrol", "srun"):
        assert shutil.which(tool, path=str(no_slurm)) is None, tool
    cmd = [
        str(Path(sys.executable).parent / "snakemake"), "--snakefile", str(repo / "Snakefile"),
        "--directory", str(tmp_path), "--profile", str(repo / "profiles/slurm"),
        "--configfile", str(tmp_path / "c.yaml"), "-n", "-p", "train",
    ]  # fmt: skip
    env = {**os.environ, "PATH": str(no_slurm)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    preflight = [line for line in out.stdout.splitlines() if line.startswith("gptflow")]
    assert preflight[0].startswith("gptflow: edit the Slurm profile first: ")
    assert preflight[1].startswith(
        "gptflow preflight: train_gpt on 1 node(s) x 8 rank(s) = 8 data parallel; micro batch "
        "2 x grad accum 1 x 8 = global batch 16"
    )
    # where the profile overrides the config, the plan says which one a job runs with
    assert (
        "  tokenize_shard runs 4 thread(s): the profile's set-threads, over the config's "
        "tokenize.workers 1" in out.stdout
    )
    train = out.stdout.split("rule train_gpt:")[1].split("\n\n")[0]
    for want in ("nodes=1", "tasks_per_node=8", "gres=gpu:8", "mpi=srun", "--signal=USR1@600"):
        assert want in train, want
    assert "gpu=" not in train.replace("gres=gpu:", "")
    # a rank's CPUs are the rule's threads, and so are its torch threads: set-threads (12,
    # sbatch's --cpus-per-task) within what the job has -- a dry run has no cores: 1
    srun = re.search(
        r"srun --kill-on-bad-exit=1 --nodes=1 --ntasks-per-node=8 --cpus-per-task=(\d+) gptflow "
        r"train --config \S+ --threads (\d+) ",
        train,
    )
    assert srun and srun[1] == srun[2], train
    assert "cpus_per_task" not in train

    # the container stage on: every rank starts in the enroot image through Pyxis
    cfg = yaml.safe_load((repo / "config/config.yaml").read_text())
    cfg["container"] = {"enabled": True}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    train = out.stdout.split("rule train_gpt:")[1].split("\n\n")[0]
    image = re.search(rf"{tmp_path}/results/containers/gptflow-[0-9a-f]{{12}}\.sqsh", train)
    assert image, train
    assert (
        f" --container-image={image[0]} --container-mounts={tmp_path}:{tmp_path} "
        f"--container-workdir={tmp_path} --no-container-mount-home gptflow train"
    ) in train
    assert "rule build_image:" in out.stdout and "rule squash_image:" in out.stdout


def test_job_ports_stay_below_the_kernels_ephemeral_range():
    """MASTER_PORT of a Slurm job is never one the kernel may have handed to an outgoing
    connection: every job id maps below this machine's ip_local_port_range."""
    from pathlib import Path

    from gptflow.train.distributed import JOB_PORT_BASE, JOB_PORT_SPAN, job_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {job_port(j) for j in range(0, 3 * JOB_PORT_SPAN, 7)}
    assert min(ports) == JOB_PORT_BASE and max(ports) == JOB_PORT_BASE + JOB_PORT_SPAN - 1
    assert max(ports) < low and min(ports) >= 1024
    assert job_port(41) != job_port(42)  # adjacent jobs on a shared node do not collide


def test_the_training_launcher_from_the_jobs_resources():
    """train_gpt's words before `gptflow train`: none on one machine; srun with every count
    (a rank's CPUs the rule's threads unless cpus_per_task is set; a count that is not a
    positive integer, such as Snakemake's unset "<TBD>", is no count); the image's Pyxis
    options on srun (sqsh) or `apptainer exec` before the command (sif); sqsh refused alone."""
    from gptflow.train.distributed import train_launcher

    assert train_launcher({"mpi": ""}, 2) == []
    assert train_launcher({}, 2) == []
    assert train_launcher({"mpi": "srun", "tasks": 4, "nodes": "<TBD>"}, 2) == [
        "srun", "--kill-on-bad-exit=1", "--ntasks=4", "--cpus-per-task=2",
    ]  # fmt: skip
    slurm = {"mpi": "srun", "nodes": 2, "tasks_per_node": 8, "cpus_per_task": 12, "mem_mb": 9}
    assert train_launcher(slurm, 1) == [
        "srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=8", "--cpus-per-task=12",
    ]  # fmt: skip
    sqsh = {"format": "sqsh", "mounts": ["/data:/data:ro"]}
    line = train_launcher(slurm, 1, sqsh, "/w/img.sqsh", "/w")
    assert line[5:] == [
        "--container-image=/w/img.sqsh",
        "--container-mounts=/w:/w,/data:/data:ro",
        "--container-workdir=/w",
        "--no-container-mount-home",
    ]
    sif = {"format": "sif", "mounts": []}
    assert train_launcher({"mpi": ""}, 2, sif, "/w/img.sif", "/w") == [
        "apptainer", "exec", "--nv", "--pwd", "/w", "--bind", "/w:/w", "/w/img.sif",
    ]  # fmt: skip
    with pytest.raises(GptflowError, match="format sqsh runs through Pyxis"):
        train_launcher({"mpi": ""}, 2, sqsh, "/w/img.sqsh", "/w")


def test_the_interface_the_ranks_rendezvous_over_reaches_every_rank(tmp_path):
    """set-resources train_gpt socket_ifname: the launcher's last words set GLOO_SOCKET_IFNAME
    and NCCL_SOCKET_IFNAME in the environment of the command after them -- under srun, in
    Apptainer, on one machine -- checked by running the rendered words before a real
    process; a name that is not an interface is refused with the fix."""
    import subprocess
    import sys

    from gptflow.train.distributed import train_launcher

    ib = ["env", "GLOO_SOCKET_IFNAME=ib0", "NCCL_SOCKET_IFNAME=ib0"]
    slurm = {"mpi": "srun", "nodes": 2, "tasks_per_node": 8, "socket_ifname": "ib0"}
    assert train_launcher(slurm, 12)[-4:] == ["--cpus-per-task=12", *ib]
    sif = {"format": "sif", "mounts": []}
    assert train_launcher({"socket_ifname": "ib0"}, 2, sif, "/w/img.sif", "/w")[-4:] == [
        "/w/img.sif", *ib,
    ]  # fmt: skip
    assert train_launcher({"socket_ifname": ""}, 2) == train_launcher({}, 2) == []
    words = train_launcher({"socket_ifname": "lo,eth0"}, 2)
    shown = "import os; print(os.environ['GLOO_SOCKET_IFNAME'], os.environ['NCCL_SOCKET_IFNAME'])"
    out = subprocess.run([*words, sys.executable, "-c", shown], capture_output=True, text=True)
    assert out.stdout == "lo,eth0 lo,eth0\n", out.stderr
    for bad in ("ib0 eth0", "ib0;reboot", 3):
        with pytest.raises(GptflowError, match=r"socket_ifname .* is not a network interface"):
            train_launcher({"socket_ifname": bad}, 2)


def test_the_ranks_on_one_machine_and_their_threads():
    """After `gptflow train --config RUN.yaml`: with nproc_per_node N > 1 and no srun,
    --nproc-per-node N and the job's threads shared among the ranks; one rank, or srun
    (which starts the ranks, each with its own CPUs), keeps every thread; and what the rule
    renders parses as `gptflow train`'s own options."""
    from gptflow.cli import build_parser
    from gptflow.train.distributed import local_ranks, rank_options

    assert rank_options({"mpi": "", "nproc_per_node": 2}, 2) == [
        "--nproc-per-node", "2", "--threads", "1",
    ]  # fmt: skip
    assert rank_options({"nproc_per_node": 4}, 10) == [
        "--nproc-per-node", "4", "--threads", "2",
    ]  # fmt: skip
    assert rank_options({"nproc_per_node": 8}, 2)[-1] == "1"  # never 0 threads
    assert rank_options({"nproc_per_node": 1}, 6) == ["--threads", "6"]
    assert rank_options({"mpi": "srun", "tasks_per_node": 8, "nproc_per_node": 8}, 12) == [
        "--threads", "12",
    ]  # fmt: skip
    assert rank_options({"nproc_per_node": "<TBD>"}, 3) == ["--threads", "3"]
    assert [local_ranks(None, 0), local_ranks(None, 4), local_ranks(2, 4)] == [1, 4, 2]
    assert [local_ranks(0, 0), local_ranks(True, 0), local_ranks("2", 3)] == [1, 1, 3]
    a = build_parser().parse_args(["train", "--config", "r.yaml", *rank_options(
        {"nproc_per_node": 2}, 2)])  # fmt: skip
    assert (a.nproc_per_node, a.threads) == (2, 1)


def test_only_mpiexec_or_mpirun_starts_one_launcher_per_node():
    """profiles/pbs's `mpi: mpiexec` (options after it are words) launches per node; srun, and
    any other value (one argv word, as the Slurm profile's), never does, and a value a shell
    would mangle (an unclosed quote) is no error."""
    from gptflow.train.distributed import launches_per_node, per_node_command

    assert launches_per_node("mpiexec") and launches_per_node("/opt/cray/pals/bin/mpiexec")
    assert launches_per_node("mpirun --bind-to none")
    for mpi in ("", "srun", "/usr/bin/srun", "two words", "it's", "mpiexec;rm"):
        assert not launches_per_node(mpi), mpi
    assert per_node_command("mpiexec --cpu-bind none", 4) == [
        "mpiexec", "--cpu-bind", "none", "-n", "4", "--ppn", "1",
    ]  # fmt: skip
    assert per_node_command("mpiexec", 1) == []


LEAVE_SCRIPT = r"""
import atexit, concurrent.futures, sys, threading, time
from pathlib import Path
from gptflow import cli
from gptflow.errors import GptflowError
from gptflow.train import device, distributed, main

out, mode = Path(sys.argv[1]), sys.argv[2]

class AtTeardown:  # freed in the interpreter's teardown, where gloo's threads abort a rank
    def __init__(self, path):
        self.path, self.open = path, open  # builtins are gone by then
    def __del__(self):
        with self.open(self.path, "w") as f:
            f.write("ran")

KEPT = AtTeardown(str(out / "teardown"))
atexit.register(lambda: (out / "atexit").write_text("ran"))

def writer(name, seconds):  # a thread still writing when training returns (or fails)
    time.sleep(seconds)
    (out / name).write_text("all of it")

def make_group():  # as the trainer does: engine.init_distributed records it, nothing else
    env = distributed.resolve({})
    distributed.export(env)
    return device.setup(env, timeout_minutes=5)

pool = concurrent.futures.ThreadPoolExecutor(1)  # idle workers wait on their queue (inductor's)
pool.submit(time.sleep, 0)
if mode == "raises":  # gptflow train, whose training fails on this rank after a save began
    def train(*args, **kwargs):
        make_group()
        threading.Thread(target=writer, args=("written", 1)).start()  # non-daemon: joined
        # the checkpoint writer's thread is a daemon (snapshot.BackgroundWriter): not waited for
        threading.Thread(target=writer, args=("abandoned", 3), daemon=True).start()
        raise GptflowError("training failed on this rank")
    main.train = train
    sys.exit(cli.main(["train", "--config", str(out / "run.yaml")]))
if mode == "group":
    make_group()
threading.Thread(target=writer, args=("written", 1)).start()  # non-daemon: joined
print("no newline at the end", end="")
sys.exit(device.leave(75))
"""


@pytest.mark.parametrize("mode", ["group", "none", "raises"])
def test_a_rank_leaves_without_the_interpreters_teardown(tmp_path, mode):
    """A rank that created a process group ends through gptflow.train.device.leave: DeepSpeed
    keeps its process groups referenced, and gloo's threads freed in the interpreter's teardown
    abort the process (SIGABRT, exit 134 after a finished run; seen here under load). leave does
    what a normal exit does that matters -- stops a thread pool's idle workers, joins the other
    non-daemon threads, runs the atexit handlers, flushes the streams -- and exits with the
    code, skipping only the teardown; a process without a process group exits as usual (fresh
    interpreters). The group is made as the trainer makes it (device.setup): the test does not
    record it itself, so init_distributed no longer recording it fails here. `gptflow train`
    whose training raises reports it in one line and still ends through leave (it did not: the
    teardown ran), without waiting for a daemon thread (the checkpoint writer's: a write in
    flight is abandoned, its step never complete)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", LEAVE_SCRIPT, str(tmp_path), mode],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == (1 if mode == "raises" else 75), out.stderr[-3000:]
    assert (tmp_path / "written").read_text() == "all of it"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "teardown").exists() == (mode == "none")
    if mode == "raises":
        errors = [line for line in out.stderr.splitlines() if "error" in line]
        assert errors == ["gptflow train: error: training failed on this rank"], out.stderr
        assert not (tmp_path / "abandoned").exists()
    else:
        assert out.stdout == "no newline at the end"


def test_every_test_script_that_makes_a_process_group_ends_through_leave():
    """Every script the tests run as a rank (a file of tests/support, a test module's script
    string) that makes a process group -- gptflow.train.engine.init_distributed, directly or
    through device.setup or the trainer -- ends through device.leave: the interpreter's
    teardown aborts such a rank now and then (pytorch/pytorch#179291; two such aborts failed
    whole-suite runs, each from a script that ended as usual)."""
    import ast

    tests = Path(__file__).resolve().parents[2]
    makes_group = re.compile(r"init_distributed\(|device\.setup\b|main import train\b")
    scripts = {str(p.relative_to(tests)): p.read_text() for p in (tests / "support").glob("*.py")}
    for path in tests.rglob("test_*.py"):
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, ast.Assign) else None
            text = value.value if isinstance(value, ast.Constant) else None
            if isinstance(text, str) and "\n" in text:
                scripts[f"{path.relative_to(tests)}:{node.targets[0].id}"] = text
    found = [name for name, text in scripts.items() if makes_group.search(text)]
    assert len(found) >= 10, found  # the scan still finds the scripts
    assert [n for n in found if not re.search(r"device\.leave\(", scripts[n])] == []
