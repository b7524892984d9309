"""Where the loop runs: one device per rank, the process group, and the tensors the loop and its
collectives use. The GPU rules of DESIGN.md ("Training at scale") live here, in one place:

- the device comes from the local rank and the GPUs this task can see, and
  ``torch.cuda.set_device`` runs before the process group or any CUDA tensor exists;
- the process group is ``cpu:gloo,cuda:nccl`` on a GPU machine (a CPU tensor in a collective is
  legal, not a crash), gloo on a CPU one, with the configured timeout;
- :meth:`Device.zeros` makes every accumulator and collective buffer of the loop, on the device;
- host decisions (stop after a signal, a lock failure) cross ranks through :meth:`Device.any_rank`
  on a CPU tensor: gloo, which never waits for the GPU's stream.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from gptflow.errors import GptflowError
from gptflow.train import engine as ds
from gptflow.train.distributed import DistEnv


def training_device(local_rank: int, local_world_size: int, cuda_count: int) -> torch.device:
    """The device of a rank: its GPU among those this task can see, else the CPU.

    One task per GPU. With every GPU of the node visible, the local rank indexes them; with
    ``--gpus-per-task`` or a cgroup-constrained step the task sees one GPU, index 0, whatever
    its local rank.
    """
    if cuda_count == 0:
        return torch.device("cpu")
    if cuda_count == 1:
        return torch.device("cuda", 0)
    if local_rank < cuda_count and local_world_size <= cuda_count:
        return torch.device("cuda", local_rank)
    raise GptflowError(
        f"local rank {local_rank} of {local_world_size} tasks on this node sees {cuda_count} "
        f"GPUs: run one task per GPU (profiles/slurm: tasks_per_node = GPUs per node), each "
        f"seeing either all of the node's GPUs or exactly one"
    )


def process_group_backend(cuda: bool) -> str:
    """NCCL for CUDA tensors and gloo for CPU ones on a GPU machine; gloo alone otherwise."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


class Device:
    """The rank's device and world: makes the loop's tensors, reduces them over the ranks."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.device = device
        self.world_size = world_size

    @property
    def name(self) -> str | None:
        """The accelerator's name (for its peak FLOP/s), None on a CPU."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None

    @property
    def capability(self) -> tuple[int, int] | None:
        """The GPU's CUDA compute capability, None on a CPU."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.get_device_capability(self.device)

    def zeros(self, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device (pinned and copied asynchronously to a GPU)."""
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place, on the device (no host sync)."""
        if self.world_size > 1:
            dist.all_reduce(t)
        return t

    def any_rank(self, *flags: bool) -> list[bool]:
        """Each host flag OR-ed over the ranks, in one all-reduce of a CPU tensor (gloo)."""
        if self.world_size == 1:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(x) for x in t.tolist()]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def shutdown(self) -> None:
        """Destroy the process group (and DeepSpeed's groups within it) before the process
        exits: a rank leaving with live gloo/NCCL threads can abort in the interpreter's
        teardown ("terminate called without an active exception"), which srun's
        --kill-on-bad-exit turns into a failed job after a finished run."""
        if dist.is_initialized():
            dist.destroy_process_group()


def setup(env: DistEnv, timeout_minutes: float) -> Device:
    """Pick and bind the rank's device, then create the process group and DeepSpeed's view of it."""
    device = training_device(env.local_rank, env.local_world_size, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # TF32 tensor cores for fp32 matmuls and convolutions (Ampere and later): the fp32
        # parts of a bf16 run, and fp32 runs, at several times the speed, as Megatron does
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # DeepSpeed places its engine on cuda:$LOCAL_RANK: name the device the task sees
        os.environ["LOCAL_RANK"] = str(device.index)
    backend = process_group_backend(device.type == "cuda")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if env.master_port is None:  # one process: an in-process store, no port to bind
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        try:
            dist.init_process_group(
                backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                timeout=timeout,
            )  # fmt: skip
        except dist.DistNetworkError as e:  # rank 0 binds MASTER_PORT; the others connect
            raise GptflowError(
                f"rank {env.rank} of {env.world_size} could not reach the rendezvous at "
                f"MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port} "
                f"({str(e).strip().splitlines()[-1]}); another job on this host may hold the "
                "port: set MASTER_PORT to a free one below 32768, or stop the other job"
            ) from None
    ds.init_distributed()  # wraps the group above (and records that this process made one)
    return Device(device, env.world_size)


def leave(code: int) -> int:
    """End a rank's process after training returned `code`, without the interpreter's teardown.

    :meth:`Device.shutdown` destroys the process groups, but DeepSpeed keeps its own references
    to them (its engine, ``deepspeed.utils.groups``), so gloo's worker threads and the work
    they hold live on until the interpreter frees those objects in its teardown, where freeing
    a tensor takes the GIL of an interpreter being torn down: SIGABRT, "terminate called without
    an active exception" (pytorch/pytorch#179291), exit code 134 after a finished run, which
    srun's --kill-on-bad-exit or torchrun turn into a failed job. Seen here under load: rank 1
    of a two-rank launch, after "done". So a process that created a process group (recorded by
    :func:`gptflow.train.engine.init_distributed`, where every group is made) does what a
    normal exit does that matters -- stops a ThreadPoolExecutor's idle workers, joins its
    other non-daemon threads, runs the atexit handlers (logging's flush, W&B's finish), flushes
    its streams -- and ends with ``os._exit(code)``, skipping only the teardown. A process
    without a process group returns `code` to exit as usual.

    What holds for checkpoint writes: the background writer's thread is a daemon
    (gptflow.train.async_save.BackgroundWriter), which this does not wait for. After a normal
    return the loop has already waited for it (``Saves.settle``: every rank's files written,
    the step marked complete) and joined it (``Saves.close``). After a failure (``gptflow
    train`` reports the exception, then ends through here too: gptflow.cli.train.cmd_train)
    a write still in flight is abandoned: its files stay in the step's hidden ``.writing-rank{r}``
    directory (the next save of that step removes it), the step is not complete (that takes
    every rank's agreement), and a resume reads the last complete one. The process group is
    not destroyed on that path: its peers see the rank leave."""
    if not ds.group_started():
        return code
    import atexit
    import contextlib
    import sys
    import threading

    # the interpreter's exit, in its order: threading's exit hooks (a ThreadPoolExecutor's
    # idle workers told to stop: joined without them, the process would wait forever), every
    # non-daemon thread joined, then the atexit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or gone: nothing to say
            stream.flush()
    os._exit(code)
