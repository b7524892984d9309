"""``gptflow train --nproc-per-node N``: N ranks on this machine through PyTorch's elastic
launcher (torchrun's own code, run in this process), keeping the trainer's exit code 75.

torchrun exits 1 whenever a worker fails, 75 included, so a retry cannot tell "saved after a
signal, run again to resume" from a crash. Here the launcher's ``ChildFailedError`` is read
(:func:`exit_code`): when the ranks exited 75 the launch exits 75; any other failure exits
with the first failed worker's code, or 128 + the signal that killed it, never 75.

SIGUSR1 and SIGTERM sent to this process are passed on to the workers (the launcher starts
each in a session of its own, so a signal to this process's group misses them): they finish
the step, save and exit 75, as under srun. SIGINT, SIGHUP and SIGQUIT stay with the elastic
agent, which stops the workers. A Slurm job does not come here: srun starts one ``gptflow
train`` per rank. A PBS job does: one launch per node (``--nnodes``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal

from gptflow.errors import GptflowError
from gptflow.train import distributed
from gptflow.train.checkpoint import ELASTIC_RUN_VAR
from gptflow.train.loop import EXIT_PREEMPTED

log = logging.getLogger("gptflow.train")

FORWARDED = (signal.SIGUSR1, signal.SIGTERM)


def launch(
    nproc_per_node: int,
    worker_args: list[str],
    nnodes: int | None = None,
    elastic=None,
    run_id: str = "gptflow",
    endpoint: str | None = None,
) -> int:
    """Run ``gptflow <worker_args>`` as `nproc_per_node` ranks (rendezvous on this host, no
    restarts); returns the exit code, 75 when every rank saved after a signal or at the exit
    interval. With `nnodes` (a PBS job: one launch per node, started by mpiexec), the ranks
    of all nodes rendezvous at the first host of ``$PBS_NODEFILE``
    (gptflow.train.distributed.node_rendezvous). With `elastic` (the run's train.elastic) this
    is one of min_nodes to max_nodes agents of run `run_id` (one per node; under srun, one
    task per node), meeting at `endpoint` or their job's first node
    (gptflow.train.distributed.elastic_rendezvous); a change of membership restarts the ranks,
    which resume from the latest checkpoint on the new number of ranks."""
    if nproc_per_node < 1:
        raise GptflowError(f"--nproc-per-node {nproc_per_node}: expected 1 or more ranks")
    env = distributed.resolve()
    if env.launcher != "single" and not (elastic is not None and env.launcher == "slurm"):
        raise GptflowError(
            f"--nproc-per-node {nproc_per_node}: this process is already rank {env.rank} of "
            f"{env.world_size} (started by {env.launcher}); drop --nproc-per-node, the "
            f"launcher that started it starts the ranks"
        )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    options = distributed.torchrun_options(nproc_per_node, nnodes, elastic, run_id, endpoint)
    if elastic is not None:
        os.environ.update(distributed.ELASTIC_ENV)
        os.environ[ELASTIC_RUN_VAR] = distributed.elastic_run(options)
    args = parse_args([*options, "--module", "gptflow", *worker_args])
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    previous = {sig: signal.signal(sig, _forward) for sig in FORWARDED}
    try:
        run(args)
    except ChildFailedError as e:
        code = exit_code(e.failures)
        if code == EXIT_PREEMPTED:
            log.warning("the %d ranks saved and stopped; exiting %d: run the same command "
                        "again to resume", nproc_per_node, EXIT_PREEMPTED)  # fmt: skip
        else:
            rank, failure = e.get_first_failure()
            log.error("rank %d failed first (exit code %d); its messages are above, the "
                      "launch exits %d", rank, failure.exitcode, code)  # fmt: skip
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def exit_code(failures: dict) -> int:
    """The launch's exit code from its failed workers (``ChildFailedError.failures``:
    {rank: ProcessFailure}, in the order the agent saw them fail; a negative exitcode is a
    signal): 75 when the first exited 75 and every other one exited 75 too or was stopped
    by the agent's SIGTERM. The agent stops the ranks still running as soon as one exits,
    and a rank exits 75 only after every rank has saved the step and passed the last
    barrier, so those ranks had nothing left to do but exit. Otherwise the first failure
    other than 75, as a shell reports it (a signal N as 128 + N)."""
    codes = [f.exitcode for f in sorted(failures.values(), key=lambda f: f.timestamp)]
    stopped = (EXIT_PREEMPTED, -signal.SIGTERM)
    if codes and codes[0] == EXIT_PREEMPTED and all(c in stopped for c in codes):
        return EXIT_PREEMPTED
    first = next(c for c in codes if c != EXIT_PREEMPTED)
    return first if first > 0 else 128 - first


def _forward(signum: int, _frame) -> None:
    """Pass a signal on to the workers (this process's children). Before they exist there
    is nothing to save: the signal then does what it would have done."""
    import psutil

    children = psutil.Process().children()
    if not children:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signum)
