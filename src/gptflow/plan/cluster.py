"""The profile against the cluster, when ``sinfo`` is on PATH: the account is one of the
user's, the partitions exist and their nodes have the GPUs, CPUs, memory and time limit asked
for.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from gptflow.errors import GptflowError
from gptflow.plan.placement import PLACEHOLDER, Placement

SINFO = ["sinfo", "--noheader", "--format=%P|%G|%D|%c|%m|%a|%l"]
ACCOUNTS = ["sacctmgr", "--noheader", "--parsable2", "show", "assoc", "format=user,account"]


@dataclass(frozen=True)
class PartitionNodes:
    """One line of ``sinfo``: a group of alike nodes of a partition."""

    partition: str
    gpus: int  # per node
    nodes: int
    cpus: int  # per node
    mem_mb: int  # per node
    time_limit: int | None = None  # minutes; None: infinite


def minutes(limit: str) -> int | None:
    """A Slurm time limit in minutes (rounded up): "infinite", "M", "M:S", "H:M:S", "D-H",
    "D-H:M", "D-H:M:S" (sbatch's --time forms; sinfo prints D-H:M:S or H:M:S)."""
    limit = limit.strip()
    if limit in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    days, dash, clock = limit.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    if dash:  # D-H, D-H:M, D-H:M:S
        h, m, sec = (*parts, 0, 0)[:3]
    else:  # M, M:S, H:M:S
        h, m, sec = (0, *parts, 0)[:3] if len(parts) < 3 else parts
    return (int(days or 0) * 24 + h) * 60 + m + (1 if sec else 0)


def parse_sinfo(text: str) -> list[PartitionNodes]:
    """``sinfo --format=%P|%G|%D|%c|%m|%a|%l`` -> node groups of the partitions that are up."""
    groups = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 7 or fields[5].strip() != "up":
            continue
        name, gres, nodes, cpus, mem, _, limit = fields
        gpus = 0
        for item in gres.split(","):
            m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
            if m:
                gpus = max(gpus, int(m[1]))
        groups.append(
            PartitionNodes(
                partition=name.rstrip("*"),
                gpus=gpus,
                nodes=int(nodes),
                cpus=int(re.sub(r"\D.*", "", cpus) or 0),
                mem_mb=int(re.sub(r"\D.*", "", mem) or 0),
                time_limit=minutes(limit),
            )
        )
    return groups


def read_accounts() -> set[str] | None:
    """The accounts this user may charge (``sacctmgr show assoc``), or None where sacctmgr is
    missing or accounting is off (then the account is left to sbatch)."""
    import getpass

    if shutil.which("sacctmgr") is None:
        return None
    try:
        out = subprocess.run(ACCOUNTS, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    user = getpass.getuser()
    found = {
        a for u, _, a in (line.partition("|") for line in out.stdout.splitlines()) if u == user
    }
    return found or None


def read_sinfo() -> list[PartitionNodes] | None:
    """The cluster's partitions from ``sinfo``, or None where there is no sinfo (a laptop, a
    login node without Slurm's commands): then nothing is checked against the cluster."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(SINFO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_sinfo(out.stdout) if out.returncode == 0 else None


def check_cluster(
    p: Placement,
    cpu_partition: str | None,
    groups: list[PartitionNodes],
    accounts: set[str] | None = None,
    runtimes: dict[str, int | None] | None = None,
) -> None:
    """The profile against the cluster: the account is one of the user's (when `accounts`
    is known), the partitions exist, some node group of the training partition has the GPUs,
    CPUs and memory a node is asked for and enough nodes, and each `runtimes` entry
    ({profile key: minutes}) is within its partition's time limit."""
    account = dict(p.settings).get("default-resources slurm_account")
    if accounts and account and not PLACEHOLDER.match(account) and account not in accounts:
        raise GptflowError(
            f"profile default-resources slurm_account is '{account}', which is not one of your "
            f"Slurm accounts ({', '.join(sorted(accounts))}); set one of them"
        )
    names = sorted({g.partition for g in groups})
    for key, name in (
        ("default-resources slurm_partition", cpu_partition),
        ("set-resources train_gpt slurm_partition", p.partition),
    ):
        if name and not PLACEHOLDER.match(name) and name not in names:
            raise GptflowError(
                f"profile {key} is '{name}', which sinfo does not list as up (partitions: "
                f"{', '.join(names) or 'none'}); set one of them"
            )
    if not p.partition or PLACEHOLDER.match(p.partition):
        return
    nodes = [g for g in groups if g.partition == p.partition]
    # ranks on a node: as the launch spreads them; `tasks` alone may be spread over any nodes
    per_node = p.ranks_per_node if p.tasks_per_node or p.nodes else 1
    asks = {
        "gpus": (p.gpus_per_node or 0, "gres GPUs per node", "gres"),
        "cpus": ((p.cpus or 1) * per_node, "CPUs per node", "set-threads train_gpt"),
        "mem_mb": (p.mem_mb or 0, "MB of memory per node", "mem_mb"),
    }
    for attr, (want, what, key) in asks.items():
        have = max(getattr(g, attr) for g in nodes)
        if want > have:
            how = (
                f"(set-threads train_gpt {p.cpus} x {per_node} ranks per node) "
                if attr == "cpus"
                else ""
            )
            raise GptflowError(
                f"set-resources train_gpt asks for {want} {what} {how}but the nodes of "
                f"partition '{p.partition}' have at most {have}; lower {key}"
            )
    total = sum(g.nodes for g in nodes)
    if (p.nodes or 1) > total:
        raise GptflowError(
            f"set-resources train_gpt nodes {p.nodes}, but partition '{p.partition}' has {total}"
        )
    for key, runtime in (runtimes or {}).items():
        part = cpu_partition if key.startswith("default") else p.partition
        limits = [g.time_limit for g in groups if g.partition == part]
        if runtime and limits and None not in limits and runtime > max(limits):
            raise GptflowError(
                f"profile {key} is {runtime} minutes, beyond partition '{part}''s time limit of "
                f"{max(limits)} minutes (sbatch would refuse the job); lower it -- a training "
                f"job requeues itself before its limit and resumes, so a shorter one only costs "
                f"a restart"
            )
