"""``gptflow build-index`` and ``gptflow train``: a run's data indices, and training (one rank,
or ``--nproc-per-node`` ranks on this machine)."""

from __future__ import annotations

import argparse

from gptflow.errors import GptflowError, failure_code
from gptflow.train.checkpoint import LOCK_WAIT_S


def add_train_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="results/runs/{run}/run.yaml")
    s.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: cores / local ranks)",
    )
    s.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="save and exit (code 75) after every step that is a multiple of this",
    )
    s.add_argument(
        "--wait-for-lock",
        type=float,
        nargs="?",
        default=0,
        const=LOCK_WAIT_S,
        metavar="SECONDS",
        help="wait this long (no value: %(const)g s) for a live trainer of the same run to "
        "finish (e.g. the job of a killed Snakemake) instead of refusing at once",
    )
    s.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="start N ranks on this machine (PyTorch's elastic launcher, as torchrun) and exit "
        "75 when they all saved after a signal or at --exit-interval (torchrun exits 1); "
        "SIGUSR1/SIGTERM to this process reach every rank. Not under srun or torchrun",
    )
    s.add_argument(
        "--nnodes",
        type=int,
        default=None,
        metavar="N",
        help="with --nproc-per-node, in a PBS job: this is one of N launches, one per node of "
        "$PBS_NODEFILE (mpiexec starts them); the ranks rendezvous at its first host",
    )

    s.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="with --nproc-per-node and train.elastic: the c10d rendezvous every agent of the "
        "run meets at (default: the job's first node, or 127.0.0.1 on a port of the run)",
    )


def cmd_train(a: argparse.Namespace) -> int:
    if a.nnodes is not None and a.nproc_per_node is None:
        raise GptflowError("--nnodes needs --nproc-per-node (the ranks of each node)")
    if a.nproc_per_node is not None:
        from gptflow.train.launch import launch

        elastic, run_id = elastic_of(a.config)
        if a.rdzv_endpoint is not None and elastic is None:
            raise GptflowError(f"--rdzv-endpoint: {a.config} sets no train.elastic")
        if elastic is not None and a.nnodes is not None:
            raise GptflowError(
                f"--nnodes {a.nnodes}: {a.config} sets train.elastic, whose min_nodes and "
                "max_nodes are the node counts; drop --nnodes"
            )
        return launch(a.nproc_per_node, rank_args(a), a.nnodes, elastic, run_id, a.rdzv_endpoint)
    from gptflow.train.device import leave
    from gptflow.train.main import train

    try:
        code = train(
            a.config,
            threads=a.threads,
            exit_interval=a.exit_interval,
            wait_for_lock=a.wait_for_lock,
        )
    except (Exception, KeyboardInterrupt) as e:  # reported here: leave below never returns
        code = failure_code(a.command, e)
    # a rank's process ends here, also after a failure (without the interpreter's teardown,
    # which can abort a process that made a process group: gptflow.train.device.leave)
    return leave(code)


def rank_args(a: argparse.Namespace) -> list[str]:
    """The command line of each rank `train --nproc-per-node` starts: its own, without
    --nproc-per-node."""
    args = ["train", "--config", a.config]
    if a.threads is not None:
        args += ["--threads", str(a.threads)]
    if a.exit_interval is not None:
        args += ["--exit-interval", str(a.exit_interval)]
    if a.wait_for_lock:
        args += ["--wait-for-lock", f"{a.wait_for_lock:g}"]
    return args


def elastic_of(config: str):
    """(train.elastic, the run's directory) of run config `config`; (None, "") when it cannot
    be read (its ranks then say why, each in its own words)."""
    from pathlib import Path

    from gptflow.train.run_config import RunConfig

    if not Path(config).is_file():
        return None, ""
    cfg = RunConfig.load(config)
    return cfg.train.elastic, str(Path(cfg.run_dir).resolve())


def add_build_index_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="results/runs/{run}/run.yaml")
    s.add_argument("--out", required=True, help="summary JSON to write")


def cmd_build_index(a: argparse.Namespace) -> int:
    import time

    from gptflow.data.dataset import run_split_datasets
    from gptflow.fsutil import write_json
    from gptflow.train.run_config import RunConfig

    cfg = RunConfig.load(a.config)
    t0 = time.perf_counter()
    data = run_split_datasets(cfg)
    seconds = time.perf_counter() - t0
    summary = {
        "run_config": a.config,
        "cache_dir": str(cfg.index_cache_dir),
        "samples": {name: len(ds) for name, ds in data.items() if ds is not None},
        "files": sorted(p.name for p in cfg.index_cache_dir.glob("*.npy")),
        "seconds": round(seconds, 3),
    }
    write_json(a.out, summary)
    print(f"{a.out}: samples {summary['samples']}, {seconds:.2f} s, cache {cfg.index_cache_dir}")
    return 0


def add_autotune_trial_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--run-dir", required=True, help="the trial's results/runs/{run}.tune.*")
    s.add_argument(
        "--memory-limit-mb",
        type=int,
        default=None,
        help="limit each process's data segment (RLIMIT_DATA) to this: autotune.memory_limit_mb",
    )
    s.add_argument(
        "trial_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the trial's launcher and gptflow train (the train_gpt job's command)",
    )


def cmd_autotune_trial(a: argparse.Namespace) -> int:
    from gptflow.train.trial import run_trial

    command = a.trial_command[1:] if a.trial_command[:1] == ["--"] else a.trial_command
    if not command:
        raise GptflowError("no command after --: give the trial's launcher and gptflow train")
    return run_trial(a.run_dir, command, a.memory_limit_mb)
