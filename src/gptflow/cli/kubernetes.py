"""``gptflow kubernetes render | driver | submit``: the subcommands of profiles/kubernetes.

- ``render --configfile CONFIG...``: each run's manifests as multi-document YAML on standard
  output, without a cluster (gptflow.kubernetes.render).
- ``driver --configfile CONFIG... [--target T] [--apply]``: the driver's ServiceAccount, Role,
  RoleBinding and Job, printed, or created in the cluster.
- ``submit --spec JSON -- COMMAND...``: what the train_gpt rule runs (gptflow.kubernetes.submit).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.kubernetes import manifests  # yaml and spec only: cheap at --help

KINDS = [*manifests.RENDERERS, "all"]


def add_kubernetes_arguments(s: argparse.ArgumentParser) -> None:
    sub = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    helps = {}
    r = sub.add_parser("render", help="each run's manifests as YAML, without a cluster")
    add_config_arguments(r)
    r.add_argument("--run", action="append", default=None, metavar="RUN",
                   help="only this run (repeatable; default: every run of the config)")  # fmt: skip
    r.add_argument("--kind", choices=KINDS, default="jobset",
                   help="which renderer: the JobSet gptflow submits (default), Kubeflow's "
                   "PyTorchJob (v1) or TrainJob (Trainer v2), T9k's DeepSpeedJob "
                   "(unvalidated), or all")  # fmt: skip
    helps["render"] = r
    d = sub.add_parser("driver", help="the driver Job running Snakemake in the cluster")
    add_config_arguments(d)
    d.add_argument("--target", default="all", help="the Snakemake target (default: all)")
    d.add_argument("--apply", action="store_true",
                   help="create the objects in the cluster (kubeconfig) instead of printing them")  # fmt: skip
    helps["driver"] = d
    m = sub.add_parser("submit", help="(the train_gpt rule's launcher) run COMMAND as a JobSet")
    m.add_argument("--spec", required=True, help="the submission as JSON (the rule's)")
    m.add_argument("pod_command", nargs=argparse.REMAINDER, metavar="command",
                   help="-- COMMAND: what every pod runs")  # fmt: skip
    helps["submit"] = m
    # `gptflow kubernetes --help` shows every action's flags
    s.epilog = "\n".join(p.format_usage().strip() for p in helps.values())
    s.formatter_class = argparse.RawDescriptionHelpFormatter


def add_config_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--configfile", nargs="+", required=True, metavar="CONFIG",
                   help="the workflow's config files, as given to snakemake --configfile")  # fmt: skip
    s.add_argument("--replace-workflow-config", action="store_true",
                   help="do not merge them over config/config.yaml (as snakemake's flag)")  # fmt: skip
    s.add_argument("--directory", default=".",
                   help="the workflow directory (the repository; default: here)")  # fmt: skip


def cmd_kubernetes(a: argparse.Namespace) -> int:
    return {"render": cmd_render, "driver": cmd_driver, "submit": cmd_submit}[a.action](a)


def cmd_render(a: argparse.Namespace) -> int:
    from gptflow.kubernetes import render

    objects = render.run_objects(Path(a.directory), a.configfile,
                                 replace=a.replace_workflow_config, runs=a.run, kind=a.kind)  # fmt: skip
    sys.stdout.write(manifests.dump_all(objects))
    return 0


def cmd_driver(a: argparse.Namespace) -> int:
    from gptflow.kubernetes import render

    namespace, objects = render.driver_objects(Path(a.directory), a.configfile,
                                               replace=a.replace_workflow_config, target=a.target)  # fmt: skip
    if not a.apply:
        sys.stdout.write(manifests.dump_all(objects))
        return 0
    print("\n".join(render.apply(namespace, objects)))
    return 0


def cmd_submit(a: argparse.Namespace) -> int:
    """Submit, then leave with os._exit: the pod watch and the log followers are daemon
    threads blocked in the API's long polls, and one that wakes while the interpreter
    finalizes aborts it (exit -6 instead of 0 or 1, seen under load; nothing on stderr). What
    they wrote is flushed first; they write nothing once submit has returned."""
    import os

    from gptflow.errors import failure_code
    from gptflow.kubernetes.spec import PodSet, check_ready
    from gptflow.kubernetes.submit import submit

    try:
        p = PodSet.from_json(a.spec)
        check_ready({"image": p.image, "volume_claim": p.volume_claim})
        command = a.pod_command[1:] if a.pod_command[:1] == ["--"] else a.pod_command
        code = submit(p, command)
    except (GptflowError, KeyboardInterrupt) as e:
        code = failure_code("kubernetes submit", e)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
