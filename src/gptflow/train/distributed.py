"""Who am I? Rank, world size, local rank and master address from srun, torchrun, or nothing;
and the launch command of the train_gpt rule (srun on Slurm, one launcher per node on PBS).

``srun`` sets ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` and the node list, not the
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` that torch.distributed reads; torchrun sets the latter;
a plain ``python`` sets neither. :func:`resolve` turns any of the three into one answer, and
:func:`export` writes it into the environment before the process group is created.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gptflow.container.image import container_launch
from gptflow.errors import GptflowError
from gptflow.train import pods


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int | None  # None: a single process, which needs no rendezvous port
    launcher: str  # "slurm", "torchrun" or "single"


def parse_first_host(nodelist: str) -> str:
    """First hostname of a Slurm node list, read here: its first item (commas inside brackets
    do not split), each bracket group's first number put in: 'gpu[07-09,12],cpu1' -> 'gpu07',
    'rack[1-2]-n[01-04]' -> 'rack1-n01'. :func:`first_host` asks Slurm first."""
    nodelist = nodelist.strip()
    m = re.match(r"(?:[^,\[\]]|\[[^\[\]]+\])+", nodelist)
    if not m or not (m.end() == len(nodelist) or nodelist[m.end()] == ","):
        raise GptflowError(f"SLURM_JOB_NODELIST '{nodelist}' is not a Slurm node list")
    return re.sub(r"\[([^\]]+)\]", lambda g: g[1].split(",")[0].split("-")[0], m.group(0))


def first_host(nodelist: str) -> str:
    """First hostname of a Slurm node list -- rank 0's host, the rendezvous address -- as
    ``scontrol show hostnames`` expands it (Slurm's own parser), or :func:`parse_first_host`
    where scontrol is not on PATH or fails."""
    if shutil.which("scontrol") is not None:
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            out = None
        if out is not None and out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    return parse_first_host(nodelist)


def _int(env: dict, key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise GptflowError(f"environment variable {key}={env[key]!r} is not an integer") from None


# Rank 0's rendezvous port inside a Slurm job: one per job id, below Linux's ephemeral range
# (ip_local_port_range, 32768-60999 by default), where the kernel hands out the source ports of
# outgoing connections -- NCCL's and the filesystem's among them -- so a job's port is never
# already taken by a connection the kernel picked.
JOB_PORT_BASE, JOB_PORT_SPAN = 10000, 20000


def job_port(job_id: int) -> int:
    """MASTER_PORT of Slurm job `job_id`: the same on every task, different for adjacent jobs."""
    return JOB_PORT_BASE + job_id % JOB_PORT_SPAN


def resolve(env: dict | None = None) -> DistEnv:
    """The process's place in the job, from the launcher's environment.

    torchrun (``RANK`` + ``WORLD_SIZE`` set) wins; then srun (``SLURM_PROCID`` with
    ``SLURM_NTASKS`` > 0 inside a step); otherwise a single process on this host.
    """
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        job_id = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get(
            "SLURM_TASKS_PER_NODE", "1"
        )
        local_world = int(re.match(r"\d+", tasks_per_node).group(0)) if tasks_per_node else 1
        return DistEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            local_world_size=local_world,
            master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
            # one port per job, so two jobs sharing a node do not collide
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else job_port(job_id),
            launcher="slurm",
        )
    return DistEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=None,  # one process: an in-process store, no port (gptflow.train.device)
        launcher="single",
    )


def export(d: DistEnv) -> None:
    """Set the torch.distributed environment variables for `d`."""
    os.environ.update(
        RANK=str(d.rank),
        WORLD_SIZE=str(d.world_size),
        LOCAL_RANK=str(d.local_rank),
        LOCAL_WORLD_SIZE=str(d.local_world_size),
        MASTER_ADDR=d.master_addr,
    )
    if d.master_port is not None:
        os.environ["MASTER_PORT"] = str(d.master_port)


def srun_command(
    mpi: str,
    *,
    nodes: int | None = None,
    tasks_per_node: int | None = None,
    tasks: int | None = None,
    cpus_per_task: int | None = None,
    container_options: list[str] | None = None,
    kill_on_bad_exit: bool = True,
) -> list[str]:
    """The launcher prefix (argv words) of the training command inside a Slurm job: one task
    per GPU.

    Snakemake's Slurm jobstep strips ``SLURM_NTASKS``, ``SLURM_CPUS_PER_TASK`` and the like
    from the batch step (and runs an ``mpi`` rule without its own srun), so every count is
    given explicitly. Empty when `mpi` is empty (one machine: a single process). Without
    `kill_on_bad_exit` (an elastic run's one agent per node) a failed task leaves the others
    running.
    """
    if not mpi:
        return []
    args = [mpi, f"--kill-on-bad-exit={int(kill_on_bad_exit)}"]
    if tasks_per_node:
        args += [f"--nodes={nodes or 1}", f"--ntasks-per-node={tasks_per_node}"]
    elif tasks:
        args += ([f"--nodes={nodes}"] if nodes else []) + [f"--ntasks={tasks}"]
    if cpus_per_task:
        args.append(f"--cpus-per-task={cpus_per_task}")
    # Pyxis/enroot (gptflow.container.image.container_launch): every rank starts inside the image
    args += container_options or []
    return args


def _count(resources: dict, name: str) -> int | None:
    """A count among the job's resources; one that is not a positive integer (Snakemake's
    unset "<TBD>", a typo) is no count."""
    value = resources.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# The variables that choose the network interface of gloo (barriers, any_rank, CPU tensors)
# and of NCCL's bootstrap and socket transport; unset, each picks the interface its host's
# name resolves to, which on some clusters is loopback or one the other nodes cannot reach.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_env(resources: dict) -> list[str]:
    """``env GLOO_SOCKET_IFNAME=IF NCCL_SOCKET_IFNAME=IF`` for the job's ``socket_ifname``
    resource (an interface name, or several comma-separated, that every node has: ``ip -brief
    address`` lists them); nothing when it is unset."""
    name = resources.get("socket_ifname")
    if name in (None, ""):
        return []
    if not isinstance(name, str) or not re.fullmatch(r"[\w.:@-]+(,[\w.:@-]+)*", name):
        raise GptflowError(
            f"set-resources train_gpt socket_ifname {name!r} is not a network interface name: "
            "set it to the interface the nodes reach each other on, e.g. ib0 or eth0 "
            "(`ip -brief address` on a compute node lists them)"
        )
    return ["env", *(f"{var}={name}" for var in SOCKET_IFNAME_VARS)]


PER_NODE_LAUNCHERS = ("mpiexec", "mpirun")  # profiles/pbs: one gptflow train per node


def launches_per_node(mpi: str) -> bool:
    """Whether the profile's ``mpi`` starts one launcher per node (``mpiexec``/``mpirun`` in a
    PBS job, each starting its node's ranks from ``$PBS_NODEFILE``) rather than one task per
    rank (``srun``, or any other program: given as one argv word, as the Slurm profile's)."""
    words = mpi.split()
    return bool(words) and os.path.basename(words[0]) in PER_NODE_LAUNCHERS


def per_node_command(mpi: str, nodes: int | None) -> list[str]:
    """The launcher prefix inside a PBS job: nothing on one node (the job script runs on it,
    and ``gptflow train --nproc-per-node`` starts its ranks); on N nodes `mpi` (``mpiexec``,
    its own options after it if any) with ``-n N --ppn 1``: one ``gptflow train`` per node of
    ``$PBS_NODEFILE`` (Cray PALS' and MPICH's spelling; PALS and Hydra read the node file
    themselves)."""
    if not nodes or nodes == 1:
        return []
    return [*mpi.split(), "-n", str(nodes), "--ppn", "1"]  # words: no shell quoting


def nodefile_hosts(path: str) -> list[str]:
    """The job's nodes, in order, from a PBS node file (``$PBS_NODEFILE``: one line per chunk
    or per MPI process, so a node may appear several times); the first is rank 0's host, where
    the ranks rendezvous."""
    try:
        lines = Path(path).read_text().split()
    except OSError as e:
        raise GptflowError(f"PBS_NODEFILE {path}: cannot read it ({e.strerror})") from None
    hosts = list(dict.fromkeys(lines))
    if not hosts:
        raise GptflowError(f"PBS_NODEFILE {path} lists no host")
    return hosts


def pbs_job_port(job_id: str) -> int:
    """MASTER_PORT of PBS job `job_id` (``1234.server``, ``1234[5].server``): the same on every
    node, as :func:`job_port`."""
    m = re.match(r"\d+", job_id)
    return job_port(int(m.group(0))) if m else 29500


def node_rendezvous(nnodes: int, env: dict | None = None) -> list[str]:
    """torchrun's rendezvous options for `nnodes` nodes of this job: on one node without a
    node file, ``--standalone`` (this host); in a PBS job, c10d at the first host of
    ``$PBS_NODEFILE`` on a port of the job id, its node count checked against `nnodes` (the
    profile's ``nodes``)."""
    env = dict(os.environ if env is None else env)
    if env.get("PET_MASTER_ADDR"):  # a Kubernetes pod (gptflow's JobSet, Trainer v2)
        return pods.pod_rendezvous(nnodes, env)
    path = env.get("PBS_NODEFILE")
    if not path:
        if nnodes == 1:
            return ["--standalone"]
        raise GptflowError(
            f"--nnodes {nnodes}: no PBS_NODEFILE in the environment; more than one node starts "
            "inside a PBS job (qsub), which lists its nodes there"
        )
    hosts = nodefile_hosts(path)
    if len(hosts) != nnodes:
        raise GptflowError(
            f"--nnodes {nnodes} (set-resources train_gpt nodes), but PBS_NODEFILE {path} lists "
            f"{len(hosts)} node(s): set nodes to the job's node count (the select line's N)"
        )
    job = env.get("PBS_JOBID", "")
    return [
        f"--nnodes={nnodes}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={hosts[0]}:{pbs_job_port(job)}", f"--rdzv-id={job or 'gptflow'}",
    ]  # fmt: skip


def run_port(run_id: str) -> int:
    """The rendezvous port of an elastic run on one machine: the same for every agent of the
    run (a hash of `run_id`, its directory), in the range of :func:`job_port`."""
    digest = int(hashlib.sha256(run_id.encode()).hexdigest()[:8], 16)
    return JOB_PORT_BASE + digest % JOB_PORT_SPAN


def elastic_rendezvous(
    elastic, run_id: str, endpoint: str | None = None, env: dict | None = None
) -> list[str]:
    """torchrun's options of an elastic launch (`elastic`: train.elastic, an ElasticConfig):
    ``--nnodes=MIN:MAX`` and a c10d rendezvous whose store the agent on the endpoint's host
    keeps. The endpoint is `endpoint` when given (``gptflow train --rdzv-endpoint``); in a PBS
    job the first host of ``$PBS_NODEFILE``, in a Slurm job the first node of the
    allocation, each on its job's port (:func:`pbs_job_port`, :func:`job_port`) and with the
    job id as the rendezvous id; else this machine's loopback on :func:`run_port`, the
    rendezvous id `run_id`'s last part (the agents of one run on one machine find each
    other, those of two runs do not)."""
    env = dict(os.environ if env is None else env)
    rdzv_id = Path(run_id).name or "gptflow"
    if env.get("PBS_NODEFILE"):
        job = env.get("PBS_JOBID", "")
        default = f"{nodefile_hosts(env['PBS_NODEFILE'])[0]}:{pbs_job_port(job)}"
        rdzv_id = job or rdzv_id
    elif env.get("SLURM_JOB_NODELIST") and env.get("SLURM_JOB_ID"):
        job = _int(env, "SLURM_JOB_ID")
        default = f"{first_host(env['SLURM_JOB_NODELIST'])}:{job_port(job)}"
        rdzv_id = str(job)
    else:
        default = f"127.0.0.1:{run_port(run_id)}"
    conf = (
        f"join_timeout={elastic.join_timeout_s},last_call_timeout={elastic.last_call_s},"
        f"keep_alive_interval={elastic.keep_alive_s}"
    )
    return [
        f"--nnodes={elastic.min_nodes}:{elastic.max_nodes}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint or default}", f"--rdzv-id={rdzv_id}", f"--rdzv-conf={conf}",
    ]  # fmt: skip


# The environment of an elastic launch's agents. torch 2.13's c10d rendezvous shares one TCP
# store between rounds and publishes its address (MASTER_ADDR) into a round's keys only when
# the node first becomes rank 0: when a node joins a running run and the earlier rank 0 stays
# rank 0, the newcomer waits for that key until its 60 s store timeout and both agents fail
# (seen here growing 1 -> 2). Opting out of the sharing publishes it every round.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def elastic_run(options: list[str]) -> str:
    """Which elastic run a launch with torchrun `options` is: its rendezvous endpoint and id
    (gptflow.train.checkpoint.ELASTIC_RUN_VAR, which the run lock reads)."""
    return " ".join(o for o in options if o.startswith(("--rdzv-endpoint=", "--rdzv-id=")))


def torchrun_options(
    nproc_per_node: int,
    nnodes: int | None = None,
    elastic=None,
    run_id: str = "gptflow",
    endpoint: str | None = None,
    env: dict | None = None,
) -> list[str]:
    """Every torchrun option of ``gptflow train --nproc-per-node`` (gptflow.train.launch), in
    one place: the rendezvous -- ``--standalone`` on one machine, :func:`node_rendezvous` on
    the `nnodes` nodes of a PBS job, :func:`elastic_rendezvous` with train.elastic (`elastic`)
    -- the ranks per node, and the restarts: none for a fixed size (a failure is the
    workflow's retry to resume), train.elastic.max_restarts when elastic (torchrun restarts
    the ranks after a failure and after every change of membership, which uses none).
    SIGINT, SIGHUP and SIGQUIT stay with the agent; SIGUSR1/SIGTERM are the launch's own."""
    if elastic is not None:
        rendezvous, restarts = (
            elastic_rendezvous(elastic, run_id, endpoint, env),
            elastic.max_restarts,
        )
    elif nnodes is None:
        rendezvous, restarts = ["--standalone"], 0
    else:
        rendezvous, restarts = node_rendezvous(nnodes, env), 0
    return [
        *rendezvous, f"--nproc-per-node={nproc_per_node}", f"--max-restarts={restarts}",
        "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
    ]  # fmt: skip


def train_launcher(
    resources: dict,
    threads: int,
    container: dict | None = None,
    image: str | None = None,
    workdir: str = ".",
    elastic: object = None,
) -> list[str]:
    """Argv words before ``gptflow train`` in the train_gpt rule, from the job's `resources`
    (``mpi``, ``nodes``, ``tasks_per_node``, ``tasks``, ``cpus_per_task``: see :func:`_count`;
    ``socket_ifname``) and `threads`: nothing on one machine; with `elastic` (train.elastic
    set) under srun one task per node, each an agent starting the node's ranks
    (:func:`rank_options`), a failed one not killing the others; under the Slurm profile (``mpi:
    srun``) the srun that starts one training task per GPU, each with the rule's threads as
    its CPUs unless ``cpus_per_task`` says otherwise; under the PBS profile (``mpi:
    mpiexec``) :func:`per_node_command`. With `container` (the config's
    ``container`` section, enabled) and its `image`: Pyxis options on that srun (sqsh) or
    ``apptainer exec --nv IMAGE`` (sif), the working directory `workdir` mounted. Last, with
    ``socket_ifname``: :func:`interface_env`, in every rank's own environment."""
    mpi = str(resources.get("mpi") or "")
    pyxis, prefix = [], []
    per_node = launches_per_node(mpi)
    if container is not None:
        pyxis, prefix = container_launch(
            container["format"],
            image,
            workdir,
            container["mounts"],
            srun=bool(mpi) and not per_node,
        )
    if per_node:
        return per_node_command(mpi, _count(resources, "nodes")) + prefix + interface_env(resources)
    cpus = _count(resources, "cpus_per_task") or threads
    if elastic and mpi:
        per_node = _count(resources, "tasks_per_node") or 1
        launcher = srun_command(
            mpi, nodes=_count(resources, "nodes") or 1, tasks_per_node=1,
            cpus_per_task=cpus * per_node, container_options=pyxis, kill_on_bad_exit=False,
        )  # fmt: skip
        return launcher + prefix + interface_env(resources)
    launcher = srun_command(
        mpi,
        nodes=_count(resources, "nodes"),
        tasks_per_node=_count(resources, "tasks_per_node"),
        tasks=_count(resources, "tasks"),
        cpus_per_task=cpus,
        container_options=pyxis,
    )
    return launcher + prefix + interface_env(resources)


def launched_ranks(
    nodes: int | None = None, tasks_per_node: int | None = None, tasks: int | None = None
) -> int:
    """How many training ranks :func:`srun_command` starts with these counts (tasks per node
    before a total, as srun reads them); one without any (a single process)."""
    if tasks_per_node:
        return (nodes or 1) * tasks_per_node
    return tasks or 1


def local_ranks(nproc_per_node: object = None, gpus: int = 0) -> int:
    """How many ranks ``gptflow train`` starts on one machine (no srun): `nproc_per_node` when
    it is a positive count (the profile's, or ``--set-resources train_gpt:nproc_per_node=N``),
    else one per visible GPU (`gpus`, gptflow.hardware.visible_gpus), else one."""
    counted = isinstance(nproc_per_node, int) and not isinstance(nproc_per_node, bool)
    return nproc_per_node if counted and nproc_per_node > 0 else max(1, gpus)


def rank_options(resources: dict, threads: int, elastic: object = None) -> list[str]:
    """Argv words after ``gptflow train --config RUN.yaml`` in the train_gpt rule: on one
    machine (no ``mpi``) with ``nproc_per_node`` N > 1, ``--nproc-per-node N`` (the elastic
    launcher of gptflow.train.launch starts the N ranks and keeps their exit code 75) and the
    job's `threads` shared among them as each rank's ``--threads``; under the PBS profile
    (:func:`launches_per_node`) ``--nproc-per-node tasks_per_node --nnodes nodes`` and
    `threads` per rank (every node's launcher starts its ranks, rendezvous from
    ``$PBS_NODEFILE``: :func:`node_rendezvous`); otherwise ``--threads`` `threads` (under srun
    each task's own CPUs: :func:`train_launcher`). With `elastic` (train.elastic set) every
    launch is a torchrun agent, ``--nproc-per-node`` even for one rank, and its node count is
    the config's (no ``--nnodes``): under srun one agent per node starts tasks_per_node
    ranks."""
    mpi = str(resources.get("mpi") or "")
    if elastic:
        if mpi:
            per_node = _count(resources, "tasks_per_node") or 1
        else:
            per_node = local_ranks(resources.get("nproc_per_node"))
        share = threads if mpi else max(1, threads // per_node)  # per rank on a cluster
        return ["--nproc-per-node", str(per_node), "--threads", str(share)]
    if launches_per_node(mpi):
        nodes, per_node = _count(resources, "nodes") or 1, _count(resources, "tasks_per_node") or 1
        return ["--nproc-per-node", str(per_node), "--nnodes", str(nodes),
                "--threads", str(threads)]  # fmt: skip
    ranks = 1 if mpi else local_ranks(resources.get("nproc_per_node"))
    if ranks == 1:
        return ["--threads", str(threads)]
    return ["--nproc-per-node", str(ranks), "--threads", str(max(1, threads // ranks))]


def requeue_job(job_id: str) -> str | None:
    """``scontrol requeue`` this Slurm job: it goes back to the queue under the same id and runs
    the rule again (the trainer resumes), which Snakemake's Slurm executor sees as a job still
    running -- no failure, no retry used. Returns why it could not (None on success)."""
    try:
        out = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol requeue {job_id}: {e}"
    if out.returncode != 0:
        return f"scontrol requeue {job_id}: {(out.stderr or out.stdout).strip()}"
    return None
